"""What auditors read in the admin: verdicts and the audit log, both strictly read-only.

Also the admin building blocks the other apps reuse: a read-only base, history without revert,
and the readable rendering of a verdict's checks. Links to other apps' pages go by URL name, so
nothing here imports them (audit is the ground floor).
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import flatten_fieldsets, quote
from django.core.exceptions import PermissionDenied
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from simple_history.admin import SimpleHistoryAdmin

from audit.models import AuditEntry, Verdict
from processors.money import format_minor


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written only by services: people may look, never add, edit or delete."""

    def get_readonly_fields(self, request, obj=None):
        # Every shown name, so no form ever has an editable field (simple_history's version view
        # builds a form without asking about change permission).
        declared = flatten_fieldsets(self.fieldsets) if self.fieldsets else list(self.fields or ())
        names = [*declared, *self.readonly_fields, *(f.name for f in self.model._meta.fields)]
        return list(dict.fromkeys(names))

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class HistoryAdmin(SimpleHistoryAdmin):
    """History shows who or what moved a row and why. Reverting is refused: it would bypass the
    services (and the state machine) that write those rows and their audit entries."""

    def revert_disabled(self, request, obj=None) -> bool:
        return True

    def history_form_view(self, request, object_id, version_id, extra_context=None):
        if request.method == "POST":
            raise PermissionDenied("History is read-only.")
        return super().history_form_view(request, object_id, version_id, extra_context)


class ReadOnlyHistoryAdmin(ReadOnlyAdmin, HistoryAdmin):
    pass


def admin_link(url_name: str, object_id: str | None, text: str | None = None) -> str:
    if not object_id:
        return "-"
    try:
        return format_html('<a href="{}">{}</a>', reverse(url_name, args=[quote(object_id)]), text or object_id)
    except NoReverseMatch:
        return str(text or object_id)


def money_or_dash(amount_minor: int | None, currency: str) -> str:
    return format_minor(amount_minor, currency) if amount_minor is not None and currency else "-"


def _cell(value: Any) -> str:
    if value in (None, "", [], {}):
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def checks_table(checks: list[dict[str, Any]], *, currency: str = "") -> SafeString:
    """A verdict's checks as a table a person can read, in the order they ran: what was checked,
    its result, the limit, what was observed, and (for a check that failed or held) why."""
    if not checks:
        return format_html("<p>{}</p>", "No checks ran (the request was refused before the policy).")
    rows = format_html_join(
        "", '<tr class="check-{}"><td class="name">{}</td><td><strong>{}</strong></td><td class="name">{}</td>'
            '<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>',
        ((c.get("result", ""), c.get("name", ""), c.get("result", ""), c.get("code", ""), _cell(c.get("limit")),
          _cell(c.get("observed")), _cell(c.get("inputs")),
          # A passing check's message describes the refusal it would have given: not news.
          c.get("message", "") if c.get("result") != "pass" else "") for c in checks))
    units = f"Amounts are in minor units of {currency}. " if currency else ""
    return format_html(
        '<table class="checks-table"><caption>{}{} checks, in the order they ran</caption><thead><tr>'
        "<th>Check</th><th>Result</th><th>Code if refused</th><th>Limit</th><th>Observed</th><th>Inputs</th>"
        "<th>Why</th></tr></thead><tbody>{}</tbody></table>", units, len(checks), rows)


def mapping_table(data: dict[str, Any]) -> SafeString:
    if not data:
        return format_html("<p>{}</p>", "-")
    rows = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", ((k, _cell(v)) for k, v in sorted(data.items())))
    return format_html('<table class="checks-table"><tbody>{}</tbody></table>', rows)


def json_block(data: Any) -> SafeString:
    return format_html("<pre>{}</pre>", json.dumps(data, indent=2, sort_keys=True, default=str))


@admin.register(Verdict)
class VerdictAdmin(ReadOnlyAdmin):
    list_display = ["id", "created_at", "operation", "outcome", "code", "caller", "amount", "payment",
                    "refund", "deduplicated", "dry_run"]
    list_filter = ["outcome", "code", "operation", "agent_name", "deduplicated", "dry_run", "currency"]
    search_fields = ["id", "payment_id", "refund_id", "idempotency_key", "agent_id", "agent_name",
                     "key_prefix", "staff_username"]
    date_hierarchy = "created_at"
    show_full_result_count = False  # a COUNT(*) over every verdict on each page is not worth it
    fieldsets = [
        (None, {"fields": ["id", "created_at", "operation", "outcome", "code", "message", "dry_run",
                           "deduplicated", "policy_version"]}),
        ("Who asked", {"fields": ["agent_name", "agent_id", "key_prefix", "staff_username", "idempotency_key"]}),
        ("What about", {"fields": ["payment", "refund", "amount", "hold_reasons"]}),
        ("Checks", {"fields": ["checks_rendered", "totals_rendered"]}),
        ("Raw", {"classes": ["collapse"], "fields": ["request_rendered", "gateway_response_rendered"]}),
    ]

    @admin.display(description="caller")
    def caller(self, obj: Verdict) -> str:
        return obj.agent_name or (f"staff: {obj.staff_username}" if obj.staff_username else "-")

    @admin.display(description="amount", ordering="amount_minor")
    def amount(self, obj: Verdict) -> str:
        return money_or_dash(obj.amount_minor, obj.currency)

    @admin.display(description="payment")
    def payment(self, obj: Verdict) -> str:
        return admin_link("admin:refundops_payment_change", obj.payment_id)

    @admin.display(description="refund")
    def refund(self, obj: Verdict) -> str:
        return admin_link("admin:refundops_refund_change", obj.refund_id)

    @admin.display(description="checks")
    def checks_rendered(self, obj: Verdict) -> SafeString:
        return checks_table(obj.checks, currency=obj.currency)

    @admin.display(description="running totals seen")
    def totals_rendered(self, obj: Verdict) -> SafeString:
        return mapping_table(obj.totals)

    @admin.display(description="request as received")
    def request_rendered(self, obj: Verdict) -> SafeString:
        return json_block(obj.request)

    @admin.display(description="gateway response")
    def gateway_response_rendered(self, obj: Verdict) -> SafeString:
        return json_block(obj.gateway_response)


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["seq", "created_at", "actor", "action", "subject_type", "subject_id", "summary"]
    list_filter = ["action", "subject_type"]
    search_fields = ["actor", "action", "subject_type", "subject_id", "data"]  # data: e.g. a payment id inside
    date_hierarchy = "created_at"
    show_full_result_count = False
    fields = ["seq", "created_at", "actor", "action", "subject_type", "subject_id", "data_rendered",
              "records_rendered", "uid", "mac", "sealed_at", "prev_hash", "hash"]

    def get_actions(self, request):
        return {}  # not even "delete selected": the log is append-only

    @admin.display(description="data")
    def summary(self, obj: AuditEntry) -> str:
        text = ", ".join(f"{k}={_cell(v)}" for k, v in sorted(obj.data.items()) if v not in (None, "", [], {}))
        return text if len(text) <= 120 else text[:119] + "…"

    @admin.display(description="data")
    def data_rendered(self, obj: AuditEntry) -> SafeString:
        return mapping_table(obj.data)

    @admin.display(description="records")
    def records_rendered(self, obj: AuditEntry) -> SafeString:
        return json_block(obj.records)

"""What auditors read in the admin: verdicts and the audit log, both strictly read-only.

Also the admin building blocks the other apps reuse: a read-only base, history without revert,
and the readable rendering of a verdict's checks. Links to other apps' pages go by URL name, so
nothing here imports them (audit is the ground floor).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.utils import flatten_fieldsets, quote
from django.core.exceptions import FieldDoesNotExist, PermissionDenied
from django.core.paginator import Paginator
from django.db import connections, models
from django.db.models import Q, QuerySet
from django.urls import NoReverseMatch, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from simple_history.admin import SimpleHistoryAdmin

from audit.models import AuditEntry, Verdict
from processors.money import format_minor


ID_SHAPE = re.compile(r"^(?P<prefix>[a-z]+)_[0-9a-f]{24}$")  # what audit.ids.new_id makes
EMAIL_SHAPE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


class ExactIdSearch:
    """A search term shaped like one of our ids (``rf_…``, ``txn_…``, ``vd_…``, ``cus_…``) or an
    email is a look-up, not a phrase: it is compared with ``=`` on the indexed columns named in
    ``exact_search`` (id prefix, or ``"@"`` for an email, to lookups), instead of Django's
    ``icontains`` across every search field and join, which reads the whole table. Any other term
    searches as before."""

    exact_search: dict[str, tuple[str, ...]] = {}

    def exact_lookups(self, term: str) -> tuple[str, ...]:
        if shape := ID_SHAPE.match(term):
            return self.exact_search.get(shape["prefix"], ())
        return self.exact_search.get("@", ()) if EMAIL_SHAPE.match(term) else ()

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        lookups = self.exact_lookups(term)
        if not lookups:
            return super().get_search_results(request, queryset, search_term)
        match = Q()
        for lookup in lookups:
            match |= Q(**{lookup: term})
        return queryset.filter(match), False  # forward joins only: one row stays one row


class IndexedValuesListFilter(admin.AllValuesFieldListFilter):
    """Django's every-value filter, for a column with a b-tree index of its own: on PostgreSQL its
    values are read by skipping through the index (a recursive CTE, one probe a distinct value)
    instead of a ``SELECT DISTINCT`` that reads the whole table on every page. The same values,
    all of them (for columns never NULL, as NULL is left out): an auditor looks for the rare action
    as much as the common one. Elsewhere (SQLite, embedded) Django's own DISTINCT."""

    def __init__(self, field, request, params, model, model_admin, field_path):
        super().__init__(field, request, params, model, model_admin, field_path)
        if connections[self.lookup_choices.db].vendor == "postgresql" and field_path == field.name:
            table, column = model._meta.db_table, field.column
            self.lookup_choices = _distinct_through_index(self.lookup_choices.db, table, column)


def _distinct_through_index(alias: str, table: str, column: str) -> list:
    """The column's distinct values, in order, NULL left out: each the next one after the last
    (``ORDER BY … LIMIT 1`` on the index), PostgreSQL's "loose index scan"."""
    qn = connections[alias].ops.quote_name
    table, column = qn(table), qn(column)
    with connections[alias].cursor() as cursor:
        cursor.execute(
            f"WITH RECURSIVE v(x) AS ((SELECT {column} FROM {table} WHERE {column} IS NOT NULL ORDER BY 1 LIMIT 1)"
            f" UNION ALL SELECT (SELECT {column} FROM {table} WHERE {column} > v.x ORDER BY 1 LIMIT 1)"
            f" FROM v WHERE v.x IS NOT NULL) SELECT x FROM v WHERE x IS NOT NULL")
        return [value for (value,) in cursor.fetchall()]


class RecentValuesListFilter(admin.AllValuesFieldListFilter):
    """Django's every-value filter for a column without an index of its own: the values among the
    list's latest ``RECENT_ROWS`` rows (read along the list's ordering index) and the one chosen,
    instead of a ``SELECT DISTINCT`` over the whole table on every page. A value seen only longer
    ago is still filtered by the URL (``?currency=…``), and kept in the list once chosen."""

    RECENT_ROWS = 10_000

    def __init__(self, field, request, params, model, model_admin, field_path):
        super().__init__(field, request, params, model, model_admin, field_path)
        if field_path != field.name:
            return  # a related model's column: Django's own
        ordering = model_admin.get_ordering(request) or model._meta.ordering or ["-pk"]
        latest = model_admin.get_queryset(request).order_by(*ordering)[:self.RECENT_ROWS]
        values = {*latest.values_list(field.name, flat=True), *([self.lookup_val[-1]] if self.lookup_val else [])}
        self.lookup_choices = sorted(values, key=lambda v: (v is None, v))


class EstimatedCountPaginator(Paginator):
    """Django's paginator, except that a long list on PostgreSQL is counted by the planner's
    estimate (``EXPLAIN``: from ``pg_class.reltuples`` and the column statistics autovacuum's
    ANALYZE keeps) instead of a ``COUNT(*)`` that reads every row it counts, on every page. A list
    the planner expects to be short (a search, a narrow filter) is counted exactly."""

    @cached_property
    def count(self) -> int:
        rows = self.object_list
        if isinstance(rows, QuerySet) and connections[rows.db].vendor == "postgresql":
            estimate = json.loads(rows.order_by().explain(format="json"))[0]["Plan"]["Plan Rows"]
            if estimate >= settings.ADMIN_ESTIMATED_COUNT_ABOVE:
                return int(estimate)
        return super().count

    def page(self, number):
        """A page's rows found by their keys first (``pk IN (… ORDER BY … LIMIT OFFSET)``), then
        read with their joins: the rows an OFFSET skips are walked in the ordering's index only,
        never joined to their payment, customer or agent (page 500 joined 50,000 rows to show 100)."""
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        top = bottom + self.per_page
        if top + self.orphans >= self.count:
            top = self.count
        rows = self.object_list
        if isinstance(rows, QuerySet) and bottom:
            return self._get_page(rows.filter(pk__in=rows.values("pk")[bottom:top]), number, self)
        return self._get_page(rows[bottom:top], number, self)



class MoneyAsMoneyAdmin:
    """On a page shown read-only, a "…_minor" field of a model with a currency reads as money
    ("12.50 USD", labelled without "minor"), and a JSON mapping as a table of its keys (its
    amounts as money too). A form a person may edit keeps its inputs as they are."""

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or self.has_change_permission(request, obj):
            return fieldsets
        return [(name, {**options, "fields": [readable_field(self.model, f) for f in options["fields"]]})
                for name, options in fieldsets]


@functools.cache
def readable_field(model, name):
    """``name`` itself, or for an amount in minor units or a JSON mapping, a read-only column
    (a callable, as the admin takes in fields and readonly_fields) that shows it readably."""
    if not isinstance(name, str):
        return name
    try:
        field = model._meta.get_field(name)
    except FieldDoesNotExist:
        return name
    has_currency = any(f.name == "currency" for f in model._meta.concrete_fields)
    if name.endswith("_minor") and isinstance(field, models.IntegerField) and has_currency:
        def show(obj) -> str:
            return money_or_dash(getattr(obj, name), obj.currency)
        show.short_description = str(field.verbose_name).removesuffix(" minor")
    elif isinstance(field, models.JSONField):
        def show(obj) -> SafeString | str:
            value = getattr(obj, name)
            currency = getattr(obj, "currency", "") if has_currency else ""
            return mapping_table(value, currency) if isinstance(value, dict) else readable(value, currency) or "-"
        show.short_description = str(field.verbose_name)
    else:
        return name
    # Not the field's own name: its help text (and a form's, "in minor units …") would show beneath.
    show.__name__ = name.removesuffix("_minor") if name.endswith("_minor") else f"{name}_readable"
    return show


class ReadOnlyAdmin(MoneyAsMoneyAdmin, admin.ModelAdmin):
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


class HistoryAdmin(MoneyAsMoneyAdmin, SimpleHistoryAdmin):
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


# Which figures of a verdict's checks are money, in minor units of the verdict's currency (the
# policy, refundops.policy, records bare integers): the checks on amounts, by name, and the inputs
# that carry amounts. Every check named "…_amount" is one (a running total of money).
MONEY_CHECKS = {"payment_refundable", "amount_within_refundable", "approval_threshold",
                "approval_threshold_cumulative", "requester_authority"}
MONEY_INPUTS = {"amount", "captured", "refunded", "reserved", "agents_on_payment", "agents_on_customer",
                "people_on_payment", "people_on_customer"}


def _money_check(name: str) -> bool:
    return name in MONEY_CHECKS or name.endswith("_amount")


def _label(key: str) -> str:
    return key.removesuffix("_minor").replace("_", " ")


def readable(value: Any, currency: str = "", *, money: bool = False) -> str:
    """A value as a person reads it: money as money (``money`` and a currency known), a mapping
    as "key: value" pairs (its "…_minor" keys as money in its own or the given currency), a list
    joined with commas, yes/no for booleans."""
    if value in (None, "", [], {}):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if money and currency and isinstance(value, int):
        return format_minor(value, currency)
    if isinstance(value, dict):
        currency = value["currency"] if isinstance(value.get("currency"), str) else currency
        return ", ".join(f"{_label(k) if currency else k}: {readable(v, currency, money=k.endswith('_minor'))}"
                         for k, v in sorted(value.items()) if v not in (None, "", [], {}))
    if isinstance(value, list):
        return ", ".join(readable(v, currency) for v in value)
    return str(value)


def _inputs(check: dict[str, Any], currency: str) -> SafeString:
    money = _money_check(check.get("name", ""))
    return format_html_join(
        "", '<span class="input">{}: {}</span><br>',
        ((_label(k), readable(v, currency, money=k in MONEY_INPUTS or (money and k == "would_be")))
         for k, v in sorted((check.get("inputs") or {}).items())))


def checks_table(checks: list[dict[str, Any]], *, currency: str = "") -> SafeString:
    """A verdict's checks as a table a person can read, in the order they ran: what was checked,
    its result, the limit, what was observed (money as money), and why it failed or held."""
    if not checks:
        return format_html("<p>{}</p>", "No checks ran (the request was refused before the policy).")
    rows = format_html_join(
        "", '<tr class="check-{}"><td class="name">{}</td><td><strong>{}</strong></td><td class="name">{}</td>'
            '<td>{}</td><td>{}</td><td class="inputs">{}</td><td class="why">{}</td></tr>',
        ((c.get("result", ""), c.get("name", ""), c.get("result", ""), c.get("code", ""),
          readable(c.get("limit"), currency, money=_money_check(c.get("name", ""))),
          readable(c.get("observed"), currency, money=_money_check(c.get("name", ""))),
          _inputs(c, currency),
          # A pass says what passed in the verdict itself; verdicts recorded before that was so carry
          # the refusal's wording on a pass, so the table explains only checks that did not pass.
          c.get("message", "") if c.get("result") != "pass" else "") for c in checks))
    return format_html(
        '<div class="checks-scroll"><table class="checks-table"><caption>{} checks, in the order they ran</caption>'
        "<thead><tr><th>Check</th><th>Result</th><th>Code if refused</th><th>Limit</th><th>Observed</th>"
        "<th>Inputs</th><th>Why</th></tr></thead><tbody>{}</tbody></table></div>", len(checks), rows)


def mapping_table(data: dict[str, Any], currency: str = "") -> SafeString:
    """Keys and values; a "…_minor" key as money when the currency is known (given, or in the data)."""
    if not data:
        return format_html("<p>{}</p>", "-")
    currency = data["currency"] if isinstance(data.get("currency"), str) else currency
    rows = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", (
        (_label(k) if currency else k, readable(v, currency, money=k.endswith("_minor")))
        for k, v in sorted(data.items())))
    return format_html('<table class="checks-table"><tbody>{}</tbody></table>', rows)


def json_block(data: Any) -> SafeString:
    return format_html("<pre>{}</pre>", json.dumps(data, indent=2, sort_keys=True, default=str))


@admin.register(Verdict)
class VerdictAdmin(ExactIdSearch, ReadOnlyAdmin):
    list_display = ["id", "created_at", "operation", "outcome", "code", "caller", "amount", "payment",
                    "refund", "deduplicated", "dry_run"]
    # No filter reads every verdict for its choices, nor does a date drill-down (DISTINCT years).
    list_filter = ["outcome", ("code", IndexedValuesListFilter), ("operation", RecentValuesListFilter),
                   ("agent_name", RecentValuesListFilter), "deduplicated", "dry_run",
                   ("currency", RecentValuesListFilter), ("created_at", admin.DateFieldListFilter)]
    search_fields = ["id", "payment_id", "refund_id", "idempotency_key", "agent_id", "agent_name",
                     "key_prefix", "staff_username"]
    show_full_result_count = False  # a COUNT(*) over every verdict on each page is not worth it
    paginator = EstimatedCountPaginator
    exact_search = {"vd": ("id",), "txn": ("payment_id",), "rf": ("refund_id",)}
    fieldsets = [
        (None, {"fields": ["id", "created_at", "operation", "outcome", "code", "message", "dry_run",
                           "deduplicated", "policy_version"]}),
        ("Who asked", {"fields": ["agent_name", "agent_id", "key_prefix", "staff_username", "idempotency_key"]}),
        ("What about", {"fields": ["payment", "refund", "amount", "held_because"]}),
        ("Checks", {"fields": ["checks_rendered", "totals_rendered"]}),
        ("Raw", {"classes": ["collapse"], "fields": ["request_rendered", "gateway_response_rendered"]}),
    ]

    @admin.display(description="caller")
    def caller(self, obj: Verdict) -> str:
        return obj.agent_name or (f"staff: {obj.staff_username}" if obj.staff_username else "-")

    @admin.display(description="amount", ordering="amount_minor")
    def amount(self, obj: Verdict) -> str:
        return money_or_dash(obj.amount_minor, obj.currency)

    @admin.display(description="held because")
    def held_because(self, obj: Verdict) -> str:
        """Each hold reason in the words of the check that held (with its figures), and its code."""
        said = {c.get("code"): c.get("message", "") for c in obj.checks or [] if c.get("result") == "hold"}
        if not obj.hold_reasons:
            return "-"
        return format_html('<ul class="hold-reasons">{}</ul>', format_html_join(
            "", "<li>{} <small>({})</small></li>", ((said.get(code) or code, code) for code in obj.hold_reasons)))

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
        return mapping_table(obj.totals, obj.currency)

    @admin.display(description="request as received")
    def request_rendered(self, obj: Verdict) -> SafeString:
        return json_block(obj.request)

    @admin.display(description="gateway response")
    def gateway_response_rendered(self, obj: Verdict) -> SafeString:
        return json_block(obj.gateway_response)


@admin.register(AuditEntry)
class AuditEntryAdmin(ExactIdSearch, ReadOnlyAdmin):
    list_display = ["seq", "created_at", "actor", "action", "subject_type", "subject_id", "summary"]
    list_filter = [("action", IndexedValuesListFilter), ("subject_type", RecentValuesListFilter),
                   ("created_at", admin.DateFieldListFilter)]
    search_fields = ["actor", "action", "subject_type", "subject_id", "data"]  # data: e.g. a payment id inside
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    # An entry names a payment or refund as its subject or inside its data (both indexed).
    exact_search = {"txn": ("subject_id", "data__payment_id"), "rf": ("subject_id", "data__refund_id")}
    fields = ["seq", "created_at", "actor", "action", "subject_type", "subject_id", "data_rendered",
              "records_rendered", "uid", "mac", "sealed_at", "prev_hash", "hash"]

    def get_actions(self, request):
        return {}  # not even "delete selected": the log is append-only

    @admin.display(description="data")
    def summary(self, obj: AuditEntry) -> str:
        text = readable(obj.data)
        return text if len(text) <= 120 else text[:119] + "…"

    @admin.display(description="data")
    def data_rendered(self, obj: AuditEntry) -> SafeString:
        return mapping_table(obj.data)

    @admin.display(description="records")
    def records_rendered(self, obj: AuditEntry) -> SafeString:
        return json_block(obj.records)

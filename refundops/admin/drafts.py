"""Policy drafts in the admin: write one, backtest it on recorded requests (tables and a chart),
run it in shadow, promote it (a proposal for a second person) or drop it. Every step goes through
``refundops.services.drafts``; each is one click and one audit entry."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from django.views.decorators.http import require_POST

from audit.admin import MoneyAsMoneyAdmin
from audit.models import Verdict
from processors.money import format_minor
from refundops.models import BacktestRun, PolicyDraft
from refundops.services import drafts
from refundops.services.backtest import BACKTEST_CHANGES_KEPT, OUTCOMES, polled_backtest_run, start_backtest

MAX_DAYS = 366
CHANGES_SHOWN = BACKTEST_CHANGES_KEPT


def _values(value: dict[str, int]) -> str:
    return ", ".join(format_minor(minor, currency) for currency, minor in sorted(value.items())) or "–"


class DraftAddForm(forms.ModelForm):
    changes = forms.JSONField(required=False, initial=dict, widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
                              help_text='What differs from the active version, e.g. {"approval_threshold_minor": '
                                        '15000} (empty: a copy of the active version to change later)')

    class Meta:
        model = PolicyDraft
        fields = ("kind", "currency", "note")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        changes = data.get("changes") or {}
        if not isinstance(changes, dict):
            self.add_error("changes", 'Give a JSON object of fields and values, e.g. {"hold_flagged": false}.')
        return data


class DraftChangeForm(forms.ModelForm):
    class Meta:
        model = PolicyDraft
        fields = ("values",)
        widgets = {"values": forms.Textarea(attrs={"rows": 14, "cols": 80})}


@admin.register(PolicyDraft)
class PolicyDraftAdmin(MoneyAsMoneyAdmin, admin.ModelAdmin):
    list_display = ("id", "kind", "currency", "status", "shadow", "note", "created_by", "created_at")
    list_filter = ("kind", "status", "shadow")
    search_fields = ("id", "note", "created_by")
    change_form_template = "admin/refundops/policydraft/change_form.html"

    def get_form(self, request, obj=None, change=False, **kwargs):
        kwargs["form"] = DraftChangeForm if obj is not None else DraftAddForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("kind", "currency", "note", "changes")
        return ("kind", "currency", "status", "shadow", "proposal", "note", "created_by", "created_at", "values")

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        fixed = ("kind", "currency", "status", "shadow", "proposal", "note", "created_by", "created_at")
        return fixed + (() if obj.status == PolicyDraft.Status.DRAFT else ("values",))

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # dropped, never deleted: the audit log names it

    @admin.display(description="proposal")
    def proposal(self, obj: PolicyDraft):
        if not obj.proposal_id:
            return "–"
        return format_html('<a href="{}">{}</a>', reverse("admin:proposals_proposal_change",
                                                          args=[quote(obj.proposal_id)]), obj.proposal_id)

    # -- writes go through the service -----------------------------------------------------------

    def save_model(self, request, obj: PolicyDraft, form, change: bool) -> None:
        try:
            if change:
                written = drafts.change_draft(draft_id=obj.pk, changes=form.cleaned_data["values"] or {},
                                              person=request.user)
            else:
                written = drafts.create_draft(kind=obj.kind, currency=obj.currency or "", person=request.user,
                                              changes=form.cleaned_data.get("changes") or {}, note=obj.note)
        except drafts.DraftError as refused:
            request._draft_refused = refused
            return
        obj.pk, obj._state.adding = written.pk, False

    def save_related(self, request, form, formsets, change) -> None:
        pass

    def log_addition(self, request, obj, message):
        pass  # the service's audit entry is the record

    def log_change(self, request, obj, message):
        pass

    def _refused(self, request) -> HttpResponse | None:
        refused = getattr(request, "_draft_refused", None)
        if refused is None:
            return None
        messages.error(request, f"{refused.code}: {refused.message}")
        return HttpResponseRedirect(request.get_full_path())

    def response_add(self, request, obj, post_url_continue=None):
        return self._refused(request) or HttpResponseRedirect(
            reverse("admin:refundops_policydraft_change", args=[quote(obj.pk)]))

    def response_change(self, request, obj):
        return self._refused(request) or HttpResponseRedirect(request.get_full_path())

    # -- one-click steps: shadow, promote, drop ---------------------------------------------------

    def get_urls(self):
        view = self.admin_site.admin_view
        steps = [path(f"<path:object_id>/{step}/", view(require_POST(self._step_view(step))),
                      name=f"refundops_policydraft_{step}") for step in ("shadow", "unshadow", "promote", "drop")]
        disagreements = path("<path:object_id>/disagreements/", view(self.disagreements_view),
                             name="refundops_policydraft_disagreements")
        backtest = [path("<path:object_id>/backtest/", view(require_POST(self.backtest_view)),
                         name="refundops_policydraft_backtest"),
                    path("<path:object_id>/backtest/<str:run_id>/progress/", view(self.backtest_progress_view),
                         name="refundops_policydraft_backtest_progress")]
        return [*steps, disagreements, *backtest, *super().get_urls()]

    def disagreements_view(self, request, object_id: str) -> HttpResponse:
        """Where the draft, running in shadow, decided otherwise than the version that bound."""
        draft = PolicyDraft.objects.filter(pk=unquote(object_id)).first()
        if draft is None or not self.has_view_permission(request, draft):
            raise PermissionDenied
        seen = Verdict.objects.filter(shadow__has_key=draft.pk)
        disagreed = seen.filter(**{f"shadow__{draft.pk}__agrees": False}).order_by("-created_at")
        rows = [(v, v.shadow[draft.pk], format_minor(v.amount_minor or 0, v.currency or "USD"))
                for v in disagreed[:CHANGES_SHOWN]]
        context = {**self.admin_site.each_context(request), "opts": self.model._meta, "draft": draft,
                   "title": f"Where {draft} disagreed with the active version", "evaluated": seen.count(),
                   "disagreed": disagreed.count(), "rows": rows, "shown": CHANGES_SHOWN}
        return TemplateResponse(request, "admin/refundops/policydraft/disagreements.html", context)

    def _step_view(self, step: str):
        def view(request, object_id: str) -> HttpResponse:
            if not self.has_change_permission(request):
                raise PermissionDenied
            draft_id, note = unquote(object_id), request.POST.get("note", "").strip()[:300]
            try:
                if step in ("shadow", "unshadow"):
                    drafts.set_shadow(draft_id=draft_id, on=step == "shadow", person=request.user)
                    messages.success(request, f"{draft_id} {'runs in shadow' if step == 'shadow' else 'no longer runs in shadow'}.")
                elif step == "promote":
                    proposal = drafts.promote_draft(draft_id=draft_id, person=request.user, note=note)
                    messages.success(request, f"Proposed ({proposal.pk}): it binds when someone else with the "
                                              f"right approves it.")
                    return HttpResponseRedirect(reverse("admin:proposals_proposal_change", args=[quote(proposal.pk)]))
                else:
                    drafts.drop_draft(draft_id=draft_id, person=request.user, note=note)
                    messages.success(request, f"{draft_id} dropped.")
            except drafts.DraftError as refused:
                messages.error(request, f"{refused.code}: {refused.message}")
            return HttpResponseRedirect(reverse("admin:refundops_policydraft_change", args=[quote(draft_id)]))
        return view

    # -- the backtest, on the draft's page ---------------------------------------------------------

    def backtest_view(self, request, object_id: str) -> HttpResponse:
        """Hand the backtest to the worker and come back to the page, which polls its progress.
        It writes a run and spends the worker's minutes: the right to change drafts, not to view."""
        draft = PolicyDraft.objects.filter(pk=unquote(object_id)).first()
        if draft is None or not self.has_change_permission(request, draft):
            raise PermissionDenied
        try:
            days = max(1, min(int(request.POST.get("days", 7)), MAX_DAYS))
        except ValueError:
            days = 7
        run = start_backtest(draft=draft, days=days, person=request.user)
        change = reverse("admin:refundops_policydraft_change", args=[quote(draft.pk)])
        return HttpResponseRedirect(f"{change}?backtest={run.pk}#backtest")

    def backtest_progress_view(self, request, object_id: str, run_id: str) -> JsonResponse:
        run = BacktestRun.objects.filter(pk=run_id, draft_id=unquote(object_id)).first()
        if run is None or not self.has_view_permission(request, run.draft):
            raise PermissionDenied
        run = polled_backtest_run(run)
        return JsonResponse({"id": run.pk, "status": run.status, "replayed": run.replayed, "total": run.total,
                             "error": run.error})

    def change_view(self, request, object_id, form_url="", extra_context=None):
        draft = PolicyDraft.objects.filter(pk=unquote(object_id)).first()
        extra: dict[str, Any] = {"days": 7, "draft": draft, **(extra_context or {})}
        run_id = request.GET.get("backtest")
        run = BacktestRun.objects.filter(pk=run_id, draft=draft).first() if draft is not None and run_id else None
        if run is not None:
            run = polled_backtest_run(run)
            extra.update(days=run.days, backtest_run=run,
                         backtest_html=backtest_html(run.result) if run.status == BacktestRun.Status.DONE else "")
        return super().change_view(request, object_id, form_url, extra)


def backtest_html(result: dict[str, Any]):
    """A finished run's result (``Backtest.as_json()``, its changes cut to the first ones kept)."""
    active, drafted = result["active"], result["draft"]

    def table(title: str, section: str):
        keys = sorted({*active[section], *drafted[section]}, key=OUTCOMES.index if section == "outcomes" else None)
        rows = format_html_join("", "<tr><th>{}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", (
            (key, a["count"] if (a := active[section].get(key)) else 0,
             d["count"] if (d := drafted[section].get(key)) else 0,
             _values(a["value"]) if a else "–", _values(d["value"]) if d else "–") for key in keys))
        return format_html('<table class="backtest-table"><thead><tr><th>{}</th><th>active</th><th>draft</th>'
                           '<th>value, active</th><th>value, draft</th></tr></thead><tbody>{}</tbody></table>',
                           title, rows)

    def side(s: dict[str, Any]) -> str:
        return " ".join(filter(None, (s["outcome"], s["code"], *s["hold_reasons"])))

    changed = format_html_join("", '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>', (
        (reverse("admin:refundops_refund_change", args=[quote(c["refund_id"])]) if c["refund_id"]
         else reverse("admin:audit_verdict_change", args=[quote(c["verdict_id"])]), c["refund_id"] or c["verdict_id"],
         f"{parse_datetime(c['at']):%Y-%m-%d %H:%M}", format_minor(c["amount"], c["currency"]),
         side(c["active"]), side(c["draft"])) for c in result["changes"][:CHANGES_SHOWN]))
    more = (format_html("<p>… and {} more: <code>manage.py policy_backtest --{} {} --days {} --json</code> lists "
                        "every one.</p>", result["changed"] - CHANGES_SHOWN, result["kind"], result["draft_id"],
                        result["days"]) if result["changed"] > CHANGES_SHOWN else "")
    return format_html(
        '<p class="backtest-summary"><strong>{}</strong> recorded requests since {} replayed; '
        '<strong>{}</strong> would change.{}</p>{}{}{}{}'
        '<h3>Refunds whose outcome changes</h3><table class="backtest-changes"><thead><tr><th>refund</th>'
        '<th>at</th><th>amount</th><th>what happened</th><th>under the draft</th></tr></thead><tbody>{}</tbody>'
        '</table>{}',
        result["requests"], f"{parse_datetime(result['since']):%Y-%m-%d %H:%M}", result["changed"],
        f" ({result['skipped']} recorded before verdicts kept their policy input: skipped.)" if result["skipped"] else "",
        outcome_chart(result), table("outcome", "outcomes"),
        table("hold reason", "hold_reasons") if active["hold_reasons"] or drafted["hold_reasons"] else "",
        table("refusal code", "codes") if active["codes"] or drafted["codes"] else "", changed, more)


def outcome_chart(result: dict[str, Any]):
    """Inline SVG, nothing loaded from anywhere: per outcome, the active version's count beside the draft's."""
    width, height, top, bottom, group = 460, 220, 20, 40, 140
    peak = max([1, *(t["count"] for side in (result["active"], result["draft"]) for t in side["outcomes"].values())])
    scale = (height - top - bottom) / peak
    bars = []
    for i, outcome in enumerate(OUTCOMES):
        for j, (side, color, label) in enumerate(((result["active"], "#9aa5b1", "active"), (result["draft"], "#2f6fb3", "draft"))):
            count = side["outcomes"][outcome]["count"]
            x, h = 30 + i * group + j * 50, count * scale
            y = height - bottom - h
            bars.append(format_html(
                '<rect class="bar {} {}" x="{}" y="{}" width="44" height="{}" fill="{}"><title>{} {}: {}</title></rect>'
                '<text x="{}" y="{}" text-anchor="middle" font-size="12">{}</text>',
                label, outcome, x, f"{y:.1f}", f"{h:.1f}", color, label, outcome, count, x + 22, f"{y - 4:.1f}", count))
        bars.append(format_html('<text x="{}" y="{}" text-anchor="middle" font-size="13">{}</text>',
                                30 + i * group + 47, height - bottom + 18, outcome))
    legend = format_html('<rect x="{}" y="4" width="10" height="10" fill="#9aa5b1"></rect><text x="{}" y="13" font-size="11">active</text>'
                         '<rect x="{}" y="4" width="10" height="10" fill="#2f6fb3"></rect><text x="{}" y="13" font-size="11">draft</text>',
                         width - 130, width - 116, width - 70, width - 56)
    return format_html('<svg class="backtest-chart" role="img" aria-label="Requests by outcome, active version '
                       'beside the draft" width="{}" height="{}" viewBox="0 0 {} {}">{}{}</svg>',
                       width, height, width, height, format_html_join("", "{}", ((b,) for b in bars)), legend)

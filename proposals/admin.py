"""Proposed changes in the admin: review one with its diff, approve or reject it; and the mixin
that turns a control's own add and change pages into proposals."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.views.decorators.http import require_POST

from audit.admin import ReadOnlyAdmin, _cell
from proposals.models import Proposal
from proposals.services import CONTROLS, ProposalError, approve_proposal, propose_change, reject_proposal


def _proposal_url(proposal: Proposal) -> str:
    return reverse("admin:proposals_proposal_change", args=[quote(proposal.pk)])


class ProposeChangeMixin:
    """A control's add and change forms propose instead of saving; the proposal takes effect
    when someone else with the same right approves it."""

    proposal_kind: str = ""

    def proposal_subject(self, obj, change: bool) -> str:
        return str(obj.pk) if change else ""

    def proposal_changes(self, request, obj, form) -> dict[str, Any]:
        return {f: getattr(obj, f) for f in CONTROLS[self.proposal_kind].fields}

    def save_model(self, request, obj, form, change) -> None:
        try:
            request._proposal = propose_change(
                kind=self.proposal_kind, subject_id=self.proposal_subject(obj, change),
                changes=self.proposal_changes(request, obj, form), proposer=request.user,
                note=form.cleaned_data.get("note", "") if "note" in form.cleaned_data else "")
        except ProposalError as refused:
            request._proposal_refused = refused

    def save_related(self, request, form, formsets, change) -> None:
        pass  # nothing is written until the proposal is approved

    def construct_change_message(self, request, form, formsets, add=False):
        return []  # nothing was saved to describe

    def log_addition(self, request, obj, message):
        pass  # the proposal and its audit entry are the record

    def log_change(self, request, obj, message):
        pass

    def _after_save(self, request) -> HttpResponse:
        refused = getattr(request, "_proposal_refused", None)
        if refused is not None:
            messages.error(request, f"{refused.code}: {refused.message}")
            return HttpResponseRedirect(request.get_full_path())
        proposal = request._proposal
        messages.success(request, f"Proposed ({proposal.pk}): {proposal.summary}. It takes effect when someone "
                                  f"else with the right approves it.")
        return HttpResponseRedirect(_proposal_url(proposal))

    def response_add(self, request, obj, post_url_continue=None) -> HttpResponse:
        return self._after_save(request)

    def response_change(self, request, obj) -> HttpResponse:
        return self._after_save(request)


def diff_table(diff: dict[str, list[Any]]):
    rows = format_html_join("", '<tr><th class="name">{}</th><td class="before">{}</td><td class="after">{}</td></tr>',
                            ((field, _cell(before), _cell(after)) for field, (before, after) in sorted(diff.items())))
    return format_html('<table class="checks-table diff"><thead><tr><th>Field</th><th>Now</th><th>Proposed</th>'
                       '</tr></thead><tbody>{}</tbody></table>', rows)


@admin.register(Proposal)
class ProposalAdmin(ReadOnlyAdmin):
    ordering = ["-proposed_at"]
    list_display = ["id", "kind", "summary", "status", "proposed_by", "proposed_at", "decided_by", "decided_at"]
    list_filter = ["status", "kind"]
    search_fields = ["id", "summary", "subject_id", "proposed_by__username", "decided_by__username"]
    list_select_related = ["proposed_by", "decided_by"]
    fields = ["id", "kind", "summary", "subject_id", "status", "changes_table", "note", "proposed_by",
              "proposed_at", "decided_by", "decided_at", "decision_note", "result_id"]

    @admin.display(description="changes")
    def changes_table(self, obj: Proposal):
        return diff_table(obj.diff)

    def can_decide(self, request, proposal: Proposal) -> bool:
        return (proposal.status == Proposal.Status.PENDING and proposal.proposed_by_id != request.user.pk
                and request.user.has_perm(CONTROLS[proposal.kind].permission))

    def get_urls(self):
        view = self.admin_site.admin_view
        return [path("<path:object_id>/approve/", view(require_POST(self.approve_view)), name="proposals_proposal_approve"),
                path("<path:object_id>/reject/", view(require_POST(self.reject_view)), name="proposals_proposal_reject"),
                *super().get_urls()]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        proposal = Proposal.objects.filter(pk=unquote(object_id)).first()
        extra = {"can_decide": proposal is not None and self.can_decide(request, proposal),
                 "own": proposal is not None and proposal.proposed_by_id == request.user.pk, **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def _decide(self, request, object_id: str, decide, verb: str) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        proposal_id = unquote(object_id)
        try:
            proposal = decide(proposal_id=proposal_id, approver=request.user,
                              note=request.POST.get("note", "").strip()[:500])
        except ProposalError as refused:
            messages.error(request, f"{refused.code}: {refused.message}")
        else:
            messages.success(request, f"{verb} {proposal.pk}: {proposal.summary}.")
            if proposal.kind == Proposal.Kind.MERCHANT_ENDPOINT and "url" in proposal.diff and not proposal.subject_id:
                from refundops.models import MerchantEndpoint

                endpoint = MerchantEndpoint.objects.get(pk=proposal.result_id)
                messages.warning(request, f"Signing secret for {endpoint.url} (shown once; give it to the "
                                          f"merchant to verify RefundOps-Signature): {endpoint.secret}")
        return HttpResponseRedirect(reverse("admin:proposals_proposal_change", args=[quote(proposal_id)]))

    def approve_view(self, request, object_id: str) -> HttpResponse:
        return self._decide(request, object_id, approve_proposal, "Approved, now in effect:")

    def reject_view(self, request, object_id: str) -> HttpResponse:
        return self._decide(request, object_id, reject_proposal, "Rejected")

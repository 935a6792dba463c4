"""The auditors' evidence pack in the admin: a form (period, merchant), the requests with their
progress (the page polls a small JSON view while a worker builds), and the download. Only people
with ``audit.build_evidencepack`` reach any of it (the auditor role and superusers); the service
audits every request and download (refundops.services.evidence_packs)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.views.decorators.http import require_GET

from audit.models import EvidencePack
from refundops.errors import ApiError
from refundops.models import Merchant
from refundops.services import evidence_packs

BUILD_PERMISSION = "audit.build_evidencepack"


class EvidencePackForm(forms.Form):
    first_day = forms.DateField(label="From", widget=forms.DateInput(attrs={"type": "date"}),
                                help_text="First day, UTC, included")
    last_day = forms.DateField(label="To", widget=forms.DateInput(attrs={"type": "date"}),
                               help_text="Last day, UTC, included")
    merchant = forms.ModelChoiceField(Merchant.objects.order_by("name"), required=False,
                                      empty_label="Every merchant")


def progress_of(pack: EvidencePack) -> dict:
    done = pack.status == EvidencePack.Status.DONE
    return {"id": pack.pk, "status": pack.status, "percent": pack.percent, "step": pack.step,
            "steps_done": pack.steps_done, "steps_total": pack.steps_total, "exceptions": pack.exception_count,
            "error": pack.error, "size_bytes": pack.size_bytes,
            "download": reverse("admin:audit_evidencepack_download", args=[quote(pack.pk)]) if done else None}


@admin.register(EvidencePack)
class EvidencePackAdmin(admin.ModelAdmin):
    """One page: the form and the requests. No add, change or delete: a pack is asked for and built."""

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.has_perm(BUILD_PERMISSION)

    def has_module_permission(self, request) -> bool:
        return request.user.has_perm(BUILD_PERMISSION)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("", view(self.changelist_view), name="audit_evidencepack_changelist"),
            path("<path:object_id>/progress/", view(self.progress_view), name="audit_evidencepack_progress"),
            # GET only: a HEAD would be audited as a download that sent nothing.
            path("<path:object_id>/download/", view(require_GET(self.download_view)),
                 name="audit_evidencepack_download"),
            *super().get_urls()[1:],  # a pack's own page and history, read-only; the list is ours
        ]

    def _allowed(self, request: HttpRequest) -> None:
        if not request.user.has_perm(BUILD_PERMISSION):
            raise PermissionDenied

    def changelist_view(self, request: HttpRequest, extra_context=None) -> HttpResponse:
        self._allowed(request)
        form = EvidencePackForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            merchant = form.cleaned_data["merchant"]
            try:
                pack = evidence_packs.request_evidence_pack(
                    username=request.user.get_username(), first_day=form.cleaned_data["first_day"],
                    last_day=form.cleaned_data["last_day"], merchant_id=merchant.pk if merchant else "")
            except ApiError as refused:
                form.add_error(None, refused.message)
            else:
                messages.success(request, f"Building {pack.pk} for {pack.first_day} to {pack.last_day}.")
                return HttpResponseRedirect(reverse("admin:audit_evidencepack_changelist"))
        packs = [evidence_packs.abandoned(pack) for pack in EvidencePack.objects.order_by("-requested_at")[:20]]
        context = {**self.admin_site.each_context(request), "opts": self.opts, "title": "Evidence packs",
                   "form": form, "rows": [(pack, progress_of(pack)) for pack in packs],
                   "fingerprint": evidence_packs.signing_key_fingerprint()}
        return TemplateResponse(request, "admin/audit/evidencepack/packs.html", context,
                                status=400 if form.errors else 200)

    def progress_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        self._allowed(request)
        pack = EvidencePack.objects.filter(pk=unquote(object_id)).first()
        if pack is None:
            raise Http404
        return JsonResponse(progress_of(evidence_packs.abandoned(pack)))

    def download_view(self, request: HttpRequest, object_id: str) -> FileResponse:
        self._allowed(request)
        try:
            pack, file = evidence_packs.open_for_download(pack_id=unquote(object_id),
                                                          username=request.user.get_username())
        except EvidencePack.DoesNotExist:
            raise Http404 from None
        name = f"evidence-{pack.first_day}-{pack.last_day}{'-' + pack.merchant_id if pack.merchant_id else ''}.zip"
        return FileResponse(file, as_attachment=True, filename=name, content_type="application/zip")

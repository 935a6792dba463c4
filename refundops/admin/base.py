"""What every admin page here shares: a safe ``next`` link, read-only inlines, money row columns."""

from django.contrib import admin
from django.http import HttpRequest
from django.utils.http import url_has_allowed_host_and_scheme

from audit.admin import admin_link, money_or_dash


def _safe_next(request: HttpRequest, default: str) -> str:
    target = request.POST.get("next") or request.GET.get("next") or ""
    if url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                       require_https=request.is_secure()):
        return target
    return default


class ReadOnlyInline:
    """Rows shown beside their parent, written only by services: look, follow the link, never edit."""

    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class RowLinks:
    """Columns most money rows share: the amount as money, and links to the payment and the verdict."""

    @admin.display(description="amount", ordering="amount_minor")
    def amount(self, obj) -> str:
        return money_or_dash(obj.amount_minor, obj.currency)

    @admin.display(description="payment")
    def payment_link(self, obj) -> str:
        return admin_link("admin:refundops_payment_change", obj.payment_id)

    @admin.display(description="verdict")
    def verdict_link(self, obj) -> str:
        return admin_link("admin:audit_verdict_change", obj.verdict_id)

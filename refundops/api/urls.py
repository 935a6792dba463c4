from django.urls import URLPattern, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from refundops.api import views


def route(pattern: str, view: type[views.AgentView], name: str) -> list[URLPattern]:
    """The contract's path, and the same path with a trailing slash (documented once)."""
    return [re_path(rf"^{pattern}$", view.as_view(), name=name),
            re_path(rf"^{pattern}/$", view.as_view(schema=None))]


urlpatterns = [
    *route(r"payments/(?P<txn_id>[^/]+)", views.PaymentDetailView, "payment-detail"),
    *route(r"payments/(?P<txn_id>[^/]+)/void", views.VoidView, "payment-void"),
    *route(r"payments/(?P<txn_id>[^/]+)/capture", views.CaptureView, "payment-capture"),
    *route(r"payment-links", views.PaymentLinkView, "payment-link-send"),
    *route(r"refunds", views.RefundCreateView, "refund-create"),
    *route(r"refunds/check", views.RefundCheckView, "refund-check"),
    *route(r"refunds/(?P<rf_id>[^/]+)", views.RefundDetailView, "refund-detail"),
    *route(r"disputes/(?P<dp_id>[^/]+)/evidence-drafts", views.EvidenceDraftView, "dispute-evidence-draft"),
    re_path(r"^schema/?$", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]),
            name="schema"),
    re_path(r"^docs/?$", SpectacularSwaggerView.as_view(url_name="schema", authentication_classes=[],
                                                        permission_classes=[]), name="docs"),
]

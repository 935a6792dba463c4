from django.urls import re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from refundops.api import views

# Paths as the contract writes them; the same path with a trailing slash works too.
urlpatterns = [
    re_path(r"^payments/(?P<txn_id>[^/]+)/?$", views.PaymentDetailView.as_view(), name="payment-detail"),
    re_path(r"^payments/(?P<txn_id>[^/]+)/void/?$", views.VoidView.as_view(), name="payment-void"),
    re_path(r"^payments/(?P<txn_id>[^/]+)/capture/?$", views.CaptureView.as_view(), name="payment-capture"),
    re_path(r"^payment-links/?$", views.PaymentLinkView.as_view(), name="payment-link-send"),
    re_path(r"^disputes/(?P<dp_id>[^/]+)/evidence-drafts/?$", views.EvidenceDraftView.as_view(),
            name="dispute-evidence-draft"),
    re_path(r"^refunds/?$", views.RefundCreateView.as_view(), name="refund-create"),
    re_path(r"^refunds/check/?$", views.RefundCheckView.as_view(), name="refund-check"),
    re_path(r"^refunds/(?P<rf_id>[^/]+)/?$", views.RefundDetailView.as_view(), name="refund-detail"),
    re_path(r"^schema/?$", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]),
            name="schema"),
    re_path(r"^docs/?$", SpectacularSwaggerView.as_view(url_name="schema", authentication_classes=[],
                                                        permission_classes=[]), name="docs"),
]

from django.conf import settings
from django.contrib import admin
from django.urls import include, path

from refundops.health import healthz, readyz
from refundops.metrics import metrics_view
from refundops.pay_views import sandbox_payment_page

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("refundops.api.urls")),
    path("webhooks/", include("refundops.webhook_urls")),
    *([path("pay/<str:link_id>", sandbox_payment_page, name="sandbox-payment-page")]
      if settings.SANDBOX_ENABLED else []),
]

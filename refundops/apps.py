from django.apps import AppConfig


class RefundOpsConfig(AppConfig):
    name = "refundops"
    label = "refundops"
    verbose_name = "Refunds"
    default_auto_field = "django.db.models.BigAutoField"

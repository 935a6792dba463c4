from django.apps import AppConfig


class RefundOpsConfig(AppConfig):
    name = "refundops"
    label = "refundops"
    verbose_name = "Refunds"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from refundops.services import drafts  # noqa: F401  (a draft follows its proposal: a signal)
        from refundops.services import totals  # noqa: F401  (a loaded dump's kept totals are dropped)
        from refundops import batching  # noqa: F401  (each new connection's prepared statements: a signal)

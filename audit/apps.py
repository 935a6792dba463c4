from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "audit"
    verbose_name = "Audit"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from simple_history.signals import pre_create_historical_record

        from audit.history import fit_change_reason

        pre_create_historical_record.connect(fit_change_reason, dispatch_uid="audit_fit_change_reason")

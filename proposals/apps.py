from django.apps import AppConfig


class ProposalsConfig(AppConfig):
    name = "proposals"
    verbose_name = "Proposed changes"
    default_auto_field = "django.db.models.BigAutoField"

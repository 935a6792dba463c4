from django.apps import AppConfig


class ProcessorsConfig(AppConfig):
    name = "processors"
    verbose_name = "Gateways"
    default_auto_field = "django.db.models.BigAutoField"

from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps
from django.db.models.signals import post_migrate
from django_otp.plugins.otp_totp import apps as otp_totp_apps


class RolesConfig(AppConfig):
    default = True
    name = "roles"
    verbose_name = "Roles"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from roles.definitions import sync_roles

        # Roles are code. After every migrate (and every test flush) each role's group holds
        # exactly its listed permissions, and the auditor views every model there is, also one
        # added after the roles' own migration. post_migrate comes once per app with models, in
        # INSTALLED_APPS order; the last one's comes after every permission exists.
        def sync_after_the_last_app(sender, apps=None, **kwargs) -> None:
            with_models = [config for config in self.apps.get_app_configs() if config.models_module]
            if sender is with_models[-1]:
                sync_roles()

        post_migrate.connect(sync_after_the_last_app, weak=False, dispatch_uid="roles.sync_roles")


class StaffAdminConfig(admin_apps.AdminConfig):
    """The admin, with sign-in by password and (where needed) a second factor: roles.signin."""

    default = False  # named in INSTALLED_APPS instead of django.contrib.admin
    default_site = "roles.signin.StaffAdminSite"


class TOTPDevicesConfig(otp_totp_apps.DefaultConfig):
    """django-otp's TOTP devices under a heading people read (the app has none: "OTP_TOTP")."""

    default = False  # named in INSTALLED_APPS instead of django_otp.plugins.otp_totp
    verbose_name = "Two-factor devices"

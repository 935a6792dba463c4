"""Staff accounts in the admin. Administrators add people and edit their names and status, but
roles come only from ``manage.py grant_role`` (audited) and superuser status from the shell:
nobody gives themselves or a friend more rights in a form. Only a superuser or the person
themselves changes a password, so an administrator cannot take over an approver's login."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied

RIGHTS = ("is_superuser", "groups", "user_permissions")

admin.site.unregister(User)


@admin.register(User)
class StaffUserAdmin(UserAdmin):
    def get_readonly_fields(self, request, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        if not request.user.is_superuser:
            fields += [*RIGHTS, "last_login", "date_joined"]
        return fields

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or request.user.is_superuser:
            return fieldsets
        return [(name, {**options, "fields": [f for f in options["fields"] if f != "password"]})
                for name, options in fieldsets]

    def has_change_permission(self, request, obj=None) -> bool:
        if obj is not None and obj.is_superuser and not request.user.is_superuser:
            return False
        return super().has_change_permission(request, obj)

    def user_change_password(self, request, id, form_url=""):
        if not request.user.is_superuser and str(request.user.pk) != str(id):
            raise PermissionDenied
        return super().user_change_password(request, id, form_url)

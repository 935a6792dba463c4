"""Staff accounts and groups in the admin. Administrators add people and edit their names and
status, but roles come only from ``manage.py grant_role`` (audited) and superuser status from a
superuser: nobody gives themselves or a friend more rights in a form. Only a superuser or the
person themselves changes a password, so an administrator cannot take over an approver's login.

Every change made here (a person or a group added, changed or deleted, a password set) is an
audit entry naming who made it, with what was before and after; never a password or its hash."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.core.exceptions import PermissionDenied
from django.db import transaction

from audit.services import record_audit

RIGHTS = ("is_superuser", "groups", "user_permissions")
USER_FIELDS = ("username", "first_name", "last_name", "email", "is_active", "is_staff", "is_superuser")

admin.site.unregister(User)
admin.site.unregister(Group)


def _permission_names(permissions) -> list[str]:
    return sorted(f"{app}.{codename}" for app, codename in permissions.values_list("content_type__app_label",
                                                                                  "codename"))


def user_state(user: User) -> dict[str, Any]:
    """What an audit entry keeps of a person: rights and status, read from the database."""
    fresh = User.objects.get(pk=user.pk)
    return {**{f: getattr(fresh, f) for f in USER_FIELDS},
            "groups": sorted(fresh.groups.values_list("name", flat=True)),
            "user_permissions": _permission_names(fresh.user_permissions)}


def group_state(group: Group) -> dict[str, Any]:
    fresh = Group.objects.get(pk=group.pk)
    return {"name": fresh.name, "permissions": _permission_names(fresh.permissions)}


def _changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    return {key: [before.get(key), value] for key, value in after.items() if before.get(key) != value}


class AuditedChanges:
    """Adds, changes and deletes in this admin write an audit entry ``<subject>.created``,
    ``.changed`` (only when something did change) or ``.deleted``, in the admin's transaction."""

    subject_type = ""  # "user", "group"
    name_field = ""  # the data key naming the row: "username", "name"

    def state(self, obj) -> dict[str, Any]:
        raise NotImplementedError

    def name_of(self, obj) -> str:
        return str(obj)

    def record(self, request, action: str, obj, **data: Any) -> None:
        record_audit(actor=f"user:{request.user.get_username()}", action=f"{self.subject_type}.{action}",
                     subject_type=self.subject_type, subject_id=str(obj.pk),
                     data={self.name_field: self.name_of(obj), **data})

    def save_model(self, request, obj, form, change) -> None:
        request._audit_before = self.state(obj) if change and obj.pk else None
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change) -> None:
        super().save_related(request, form, formsets, change)  # groups and permissions are saved here
        obj, before = form.instance, getattr(request, "_audit_before", None)
        after = self.state(obj)
        if before is None:
            self.record(request, "created", obj, after=after)
        elif changes := _changes(before, after):
            self.record(request, "changed", obj, changes=changes)

    def delete_model(self, request, obj) -> None:
        before, pk = self.state(obj), obj.pk
        super().delete_model(request, obj)
        obj.pk = pk
        self.record(request, "deleted", obj, before=before)

    def delete_queryset(self, request, queryset) -> None:
        for obj in queryset:  # one entry per row, as if deleted one by one
            self.delete_model(request, obj)


@admin.register(User)
class StaffUserAdmin(AuditedChanges, UserAdmin):
    subject_type = "user"
    name_field = "username"

    def state(self, obj: User) -> dict[str, Any]:
        return user_state(obj)

    def name_of(self, obj: User) -> str:
        return obj.get_username()

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
        with transaction.atomic():
            response = super().user_change_password(request, id, form_url)
            if request.method == "POST" and response.status_code == 302:  # saved (a form error is a 200)
                self.record(request, "password_changed", User.objects.get(pk=unquote(id)))
        return response


@admin.register(Group)
class StaffGroupAdmin(AuditedChanges, GroupAdmin):
    subject_type = "group"
    name_field = "name"

    def state(self, obj: Group) -> dict[str, Any]:
        return group_state(obj)

"""Signing in to the admin: password (throttled by django-axes), then a TOTP code (django-otp)
for anyone who has a device, and in production mode for everyone who can change anything.

Read-only staff (auditors) may use a device but need not. In development mode (scripts/run, the
test suite) nobody is asked to enrol, so the demo logins keep working with a password alone.
A person who must have a second factor and has none enrols on first sign-in: the page shows
the key for an authenticator app and confirms it with a first code.
"""

from __future__ import annotations

from base64 import b32encode
from functools import partial

import django_otp
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django_otp.plugins.otp_totp.models import TOTPDevice
from simple_history.admin import SimpleHistoryAdmin

from audit.exports import export_changelist, export_history


# Permissions that only read, beside the view_ ones: the auditor's evidence pack (it reads the period
# and writes only its own audited request), so auditors still sign in with a password alone.
READS = {"audit.build_evidencepack"}


def needs_second_factor(user) -> bool:
    """Approvers, operators, administrators and superusers: anyone who can change something."""
    if not settings.PRODUCTION or not user.is_authenticated:
        return False
    return user.is_superuser or any(not p.partition(".")[2].startswith("view_") and p not in READS
                                    for p in user.get_all_permissions())


def _has_device(user) -> bool:
    return TOTPDevice.objects.filter(user=user, confirmed=True).exists()


class StaffAuthenticationForm(AdminAuthenticationForm):
    otp_token = forms.CharField(label="Code from your authenticator app", required=False, max_length=8,
                                widget=forms.TextInput(attrs={"autocomplete": "one-time-code", "inputmode": "numeric"}))

    def clean(self):
        data = super().clean()
        user = self.get_user()
        if user is not None and _has_device(user):
            device = django_otp.match_token(user, (data.get("otp_token") or "").strip())
            if device is None:
                # Counted like a wrong password, so guessing codes is throttled too.
                user_login_failed.send(sender=__name__, credentials={"username": user.get_username()},
                                       request=self.request)
                raise forms.ValidationError("Enter the current code from your authenticator app.",
                                            code="otp_required")
            user.otp_device = device  # django_otp marks the session verified on login
        return data


def could_be_pk(model, value: str) -> bool:
    """Whether ``value`` could be a primary key of ``model`` ("abc" cannot be a number)."""
    try:
        model._meta.pk.to_python(value)
    except ValidationError:
        return False
    return True


class IdsChecked:
    """Ids no row can have ("abc" for a numeric key), which Django's admin and simple_history pass
    to a query as they are (a ValueError: 500): a changelist action on such a selection does nothing
    and the list says why; a history page for such an id is not found. An empty ``?_to_field=`` is
    no field: Django checks a non-empty one against the fields it allows, and looks an empty one up
    (``get_field('')``: 500), so here it means the primary key, as no ``_to_field`` does."""

    def get_object(self, request, object_id, from_field=None):
        return super().get_object(request, object_id, from_field or None)

    def history_view(self, request, object_id, extra_context=None):
        if not could_be_pk(self.model, unquote(object_id)):
            raise Http404("No such object.")
        return super().history_view(request, object_id, extra_context)

    def response_action(self, request, queryset):
        if not all(could_be_pk(self.model, value) for value in request.POST.getlist(ACTION_CHECKBOX_NAME)):
            self.message_user(request, "Nothing was done: the selection holds an id no row can have.",
                              messages.WARNING)
            return None  # as Django answers an empty selection: the list again
        return super().response_action(request, queryset)


class StaffAdminSite(admin.AdminSite):
    login_form = StaffAuthenticationForm
    login_template = "admin/roles/login.html"
    site_url = None  # no public site to "view": "/" answers 404
    # The model list beside every page takes 300 px a 1366 px laptop needs for the tables; the
    # index and the breadcrumbs lead everywhere it did.
    enable_nav_sidebar = False

    def register(self, model_or_iterable, admin_class=None, **options):
        # Every model's admin, whoever wrote it, checks the ids its actions are given.
        admin_class = admin_class or admin.ModelAdmin
        checked = type(admin_class.__name__, (IdsChecked, admin_class), {"__module__": admin_class.__module__})
        super().register(model_or_iterable, checked, **options)

    def has_permission(self, request: HttpRequest) -> bool:
        return super().has_permission(request) and (
            not needs_second_factor(request.user) or request.user.is_verified())

    def login(self, request, extra_context=None):
        if request.user.is_authenticated and request.user.is_staff and not self.has_permission(request) \
                and needs_second_factor(request.user):
            return HttpResponseRedirect(reverse("admin:second_factor"))
        return super().login(request, extra_context)

    def get_urls(self):
        return [path("second-factor/", self.second_factor_view, name="second_factor"), *self.export_urls(),
                *super().get_urls()]

    def export_urls(self):
        """``<app>/<model>/export.csv`` for every list (as filtered by its query string), and
        ``<app>/<model>/<id>/history/export.csv`` for every model with history (audit.exports)."""
        urls = []
        for model, model_admin in self._registry.items():
            app_label, model_name = model._meta.app_label, model._meta.model_name
            urls.append(path(f"{app_label}/{model_name}/export.csv",
                             self.admin_view(partial(export_changelist, model_admin=model_admin)),
                             name=f"{app_label}_{model_name}_export_csv"))
            if isinstance(model_admin, SimpleHistoryAdmin):
                urls.append(path(f"{app_label}/{model_name}/<path:object_id>/history/export.csv",
                                 self.admin_view(partial(export_history, model_admin=model_admin)),
                                 name=f"{app_label}_{model_name}_history_export_csv"))
        return urls

    def second_factor_view(self, request: HttpRequest) -> HttpResponse:
        """Enrol a TOTP device (or confirm one) and mark this session verified."""
        if not (request.user.is_authenticated and request.user.is_staff):
            return HttpResponseRedirect(reverse("admin:login"))
        device = (TOTPDevice.objects.filter(user=request.user, confirmed=True).first()
                  or TOTPDevice.objects.filter(user=request.user, confirmed=False).first()
                  or TOTPDevice.objects.create(user=request.user, name="authenticator", confirmed=False))
        error = ""
        if request.method == "POST":
            if device.verify_token((request.POST.get("otp_token") or "").strip()):
                if not device.confirmed:
                    device.confirmed = True
                    device.save(update_fields=["confirmed"])
                django_otp.login(request, device)
                return HttpResponseRedirect(reverse("admin:index"))
            error = "That code is not right; enter the one your app shows now."
        context = {**self.each_context(request), "title": "Second factor", "device": device, "error": error,
                   "key": b32encode(device.bin_key).decode() if not device.confirmed else "",
                   "config_url": device.config_url if not device.confirmed else ""}
        return TemplateResponse(request, "admin/roles/second_factor.html", context)


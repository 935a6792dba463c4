"""Signing in to the admin: throttled (django-axes), and a TOTP second factor (django-otp) for
anyone who can change something in production mode; in development a password is enough.
(Issue 9, finding 5.)"""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django_otp.oath import TOTP
from django_otp.plugins.otp_totp.models import TOTPDevice

pytestmark = pytest.mark.django_db

INDEX = "/admin/"
LOGIN = "/admin/login/?next=/admin/"


def person(username: str, role: str) -> User:
    user = User.objects.create_user(username, password="right-pw")
    call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    return user


def sign_in(client: Client, username: str, password: str = "right-pw", code: str = ""):
    return client.post(LOGIN, {"username": username, "password": password, "otp_token": code})


def code_for(device: TOTPDevice, *, steps_ahead: int = 0) -> str:
    totp = TOTP(device.bin_key, step=device.step, t0=device.t0, digits=device.digits, drift=device.drift)
    totp.time = time.time() + steps_ahead * device.step
    return f"{totp.token():0{device.digits}d}"


def test_repeated_wrong_passwords_lock_the_login_even_for_the_right_one(settings):
    person("approver", "finance approver")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert sign_in(client, "approver", "wrong-pw").status_code == 200  # the form again, with an error
    assert sign_in(client, "approver", "wrong-pw").status_code == 429
    locked = sign_in(client, "approver")
    assert locked.status_code == 429
    assert client.get(INDEX).status_code == 302  # still not signed in


def test_in_development_a_password_is_enough_for_every_role():
    for role in ("finance approver", "operator", "auditor"):
        person(role.replace(" ", "-"), role)
        client = Client()
        assert sign_in(client, role.replace(" ", "-")).status_code == 302
        assert client.get(INDEX).status_code == 200


def test_in_production_an_approver_enrols_a_second_factor_before_any_page_and_needs_it_after(settings):
    settings.PRODUCTION = True
    settings.OTP_TOTP_THROTTLE_FACTOR = 0  # the wrong code below would otherwise delay the right one
    person("approver", "finance approver")
    client = Client()
    assert sign_in(client, "approver").status_code == 302
    assert client.get(INDEX).status_code == 302
    assert client.get("/admin/refundops/refund/").status_code == 302
    setup = client.get(LOGIN, follow=True)
    assert setup.redirect_chain[-1][0] == "/admin/second-factor/" and b"totp-key" in setup.content
    device = TOTPDevice.objects.get(user__username="approver")
    assert client.post("/admin/second-factor/", {"otp_token": "000000" if code_for(device) != "000000" else "111111"}
                       ).status_code == 200
    assert client.post("/admin/second-factor/", {"otp_token": code_for(device)}).status_code == 302
    assert client.get("/admin/refundops/refund/").status_code == 200

    again = Client()
    assert sign_in(again, "approver").status_code == 200  # the form again: the code is missing
    assert again.get(INDEX).status_code == 302
    assert sign_in(again, "approver", code=code_for(device, steps_ahead=1)).status_code == 302
    assert again.get(INDEX).status_code == 200


def test_in_production_operators_need_a_second_factor_and_auditors_may_read_without(settings):
    settings.PRODUCTION = True
    person("operator", "operator")
    person("auditor", "auditor")
    operator, auditor = Client(), Client()
    sign_in(operator, "operator")
    sign_in(auditor, "auditor")
    assert operator.get("/admin/refundops/platformstate/").status_code == 302
    assert auditor.get("/admin/refundops/platformstate/").status_code == 200

"""The agent API passes the site's session, user, second-factor, messages and history middleware by
(refundops.middleware): it authenticates by key alone. Every protection stays: a staff session
grants the API nothing, the admin and its sign-in keep CSRF and the whole chain, and the API's
answers keep their security headers and request id, under WSGI and ASGI. (Issue 11.)"""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client, override_settings
from rest_framework.test import APIClient

from refundops.models import Refund
from tests.conftest import make_payment, post
from tests.test_asgi import ASGI_MIDDLEWARE

pytestmark = pytest.mark.django_db


def superuser():
    return get_user_model().objects.create_superuser("boss", password="right-pw")


def refund_body(payment) -> dict:
    return {"transaction_id": payment.pk, "amount": 100, "reason": "customer_request"}


def test_an_api_request_opens_no_session_and_a_staff_session_grants_the_api_nothing(api, policy):
    """Fails before refundops.middleware on the first assertion about the request: the API request
    loaded a session and a message store it never used."""
    boss = superuser()
    api.force_login(boss)  # a signed-in staff member's cookie goes along with the key
    payment = make_payment()
    answer = post(api, "/api/v1/refunds", refund_body(payment))
    assert answer.status_code == 201 and answer.json()["refund"]["status"] == "approved"
    request = answer.wsgi_request
    assert not hasattr(request, "session") and not hasattr(request, "_messages")
    assert not answer.cookies  # no session or CSRF cookie set on an API answer
    refund = Refund.objects.get(pk=answer.json()["refund"]["id"])
    assert [h.history_user for h in refund.history.all()] == [None, None]  # the key acted, not the cookie

    cookie_only = APIClient()
    cookie_only.force_login(boss)
    refused = post(cookie_only, "/api/v1/refunds", refund_body(make_payment()))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "UNAUTHENTICATED"
    assert Refund.objects.count() == 1


def test_the_admin_and_its_sign_in_keep_csrf_sessions_and_the_second_factor():
    boss = superuser()
    strict = Client(enforce_csrf_checks=True)
    assert strict.post("/admin/login/", {"username": "boss", "password": "right-pw"}).status_code == 403
    strict.force_login(boss)
    assert strict.post("/admin/logout/").status_code == 403  # a signed-in POST without the token
    page = strict.get("/admin/")
    assert page.status_code == 200
    request = page.wsgi_request
    assert request.session.session_key and request.user == boss and request.user.is_verified() is False
    assert hasattr(request, "_messages")
    token = strict.get("/admin/password_change/").cookies["csrftoken"].value
    assert strict.post("/admin/logout/", HTTP_X_CSRFTOKEN=token).status_code == 200  # with it, signed out


def test_api_answers_keep_their_security_headers_and_request_id(api, policy):
    payment = make_payment()
    for answer in (api.get(f"/api/v1/payments/{payment.pk}", HTTP_X_REQUEST_ID="req-headers-1"),
                   APIClient().get(f"/api/v1/payments/{payment.pk}"),  # refused: no key
                   api.get("/api/v1/no-such-route")):
        assert answer["X-Frame-Options"] == "DENY" and answer["X-Content-Type-Options"] == "nosniff"
        assert answer["Referrer-Policy"] == "same-origin" and answer["Cross-Origin-Opener-Policy"] == "same-origin"
        assert answer["X-Request-ID"]
    assert answer.status_code == 404
    assert api.get("/api/v1/docs").status_code == 200  # the Swagger page renders its template without a session


def test_under_asgi_the_api_passes_by_and_the_admin_keeps_its_session(api, policy):
    payment = make_payment()
    raw = api._credentials["HTTP_AUTHORIZATION"]
    with override_settings(MIDDLEWARE=ASGI_MIDDLEWARE):
        client = AsyncClient()
        answer = async_to_sync(client.get)(f"/api/v1/payments/{payment.pk}", headers={"Authorization": raw})
        login = async_to_sync(client.get)("/admin/login/")
    assert answer.status_code == 200 and not hasattr(answer.asgi_request, "session")
    assert login.status_code == 200 and hasattr(login.asgi_request, "session") and "csrftoken" in login.cookies


@pytest.mark.parametrize("accept, indented", [
    (None, False), ("*/*", False), ("application/json", False), ("application/json; indent=4", True),
    ("text/html;q=0.9, application/json;q=0.8", False), ("text/html", False), ("image/png, text/*", False)])
def test_the_api_answers_json_whatever_the_accept_header_asks(api, policy, accept, indented):
    """refundops.api.views.JSONNegotiation skips DRF's parsing only where its answer is known. An
    Accept naming no JSON fails before (DRF's NotAcceptable went unhandled: 500), gets JSON after."""
    payment = make_payment()
    headers = {"HTTP_ACCEPT": accept} if accept else {}
    answer = api.get(f"/api/v1/payments/{payment.pk}", **headers)
    assert answer.status_code == 200 and answer["Content-Type"] == "application/json"
    assert answer.json()["id"] == payment.pk and (b'\n    "id"' in answer.content) == indented
    assert api.get(f"/api/v1/payments/{payment.pk}?format=json", **headers).status_code == 200
    assert api.get(f"/api/v1/payments/{payment.pk}?format=xml").status_code == 404  # DRF's, as before

"""Every admin URL fuzzed as each role sees it: every named route of the admin site (changelists,
add, change, history, delete, exports, the held queue and dashboard, approve and reject, …) with
generated path values (real ids about half the time, or NUL, percent signs, very long, non-ASCII,
dots) and query strings of the admin's own filters, search, ordering and paging with hostile
values, and changelist actions on hostile selections, as an anonymous visitor, a superuser and
each of the five roles. None may answer 5xx (a streamed export is read to its end).

Bounded for CI (FUZZ_ADMIN_EXAMPLES, default 120 requests); ``scripts/fuzz N`` runs longer."""

from __future__ import annotations

import os
from urllib.parse import urlencode

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import NoReverseMatch, URLPattern, URLResolver, reverse
from hypothesis import HealthCheck, assume, given, settings as hypothesis_settings, strategies as st

from roles.definitions import ROLES
from tests.browser import populate

pytestmark = pytest.mark.django_db

EXAMPLES = int(os.environ.get("FUZZ_ADMIN_EXAMPLES", os.environ.get("FUZZ_EXAMPLES", "120")))
AS = ["anonymous", "superuser", *ROLES]

hostile_text = st.one_of(
    st.sampled_from(["\x00", "rf_\x00", "%00", "%", "..", ".", "-1", "0", "99999999999999999999", "1e3", "null",
                     "true", "[]", "{}", "' OR 1=1 --", "<script>", "\u2028", "𝔘𝔫𝔦", "x" * 5_000, " ", "+", "__"]),
    st.text(max_size=30),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=10).map(lambda t: t + "\x00"),
)
QUERY_NAMES = ["q", "o", "p", "e", "all", "_popup", "_to_field", "_changelist_filters", "status__exact",
               "status", "created_at__gte", "created_at__lt", "created_at__date", "id__in", "pk", "currency__exact",
               "outcome__exact", "action__exact", "processor__exact", "kind__exact", "merchant__id__exact",
               "agent__id__exact", "verified__exact", "amount_minor__gte", "payment__id__exact", "%00"]


def admin_routes() -> list[tuple[str, list[str]]]:
    """(url name, its path parameters) for every named route of the admin site."""
    routes = []

    def walk(patterns, converters: dict) -> None:
        for pattern in patterns:
            found = {**converters, **getattr(pattern.pattern, "converters", {})}
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, found)
            elif isinstance(pattern, URLPattern) and pattern.name:
                routes.append((pattern.name, sorted(found) or list(pattern.pattern.regex.groupindex)))
    walk(admin.site.get_urls(), {})
    return routes


ROUTES = admin_routes()


@pytest.fixture
def world(db):
    world = populate()
    clients = {"anonymous": Client(raise_request_exception=True)}
    superuser = User.objects.create_superuser("fuzz-root", "root@example.com", "pw")
    clients["superuser"] = Client(raise_request_exception=True)
    clients["superuser"].force_login(superuser)
    for role in ROLES:
        username = "fuzz-" + role.replace(" ", "-")
        User.objects.create_user(username, password="pw")
        call_command("grant_role", username, role, stdout=open(os.devnull, "w"))
        clients[role] = Client(raise_request_exception=True)
        clients[role].force_login(User.objects.get(username=username))
    ids = [str(pk) for model, model_admin in admin.site._registry.items()
           for pk in model._default_manager.order_by("pk").values_list("pk", flat=True)[:2]]
    return world, clients, ids


def read_whole(response) -> int:
    if response.streaming:
        b"".join(response.streaming_content)
    return response.status_code


def test_the_fuzzed_routes_are_every_admin_route():
    names = {name for name, _ in ROUTES}
    assert len(names) >= 4 * len(admin.site._registry)  # list, add, change, history (and delete) per model
    assert {"refundops_refund_approve", "refundops_refund_held", "refundops_dashboard"} <= names


def test_every_admin_url_answers_hostile_paths_and_queries_without_a_server_error(world):
    _, clients, ids = world
    tried = 0
    values = st.one_of(st.sampled_from(ids), hostile_text)

    @given(role=st.sampled_from(AS), route=st.sampled_from(ROUTES), data=st.data(),
           query=st.dictionaries(st.sampled_from(QUERY_NAMES), hostile_text, max_size=3))
    @hypothesis_settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                         database=None)
    def visit(role: str, route: tuple[str, list[str]], data, query: dict[str, str]) -> None:
        nonlocal tried
        name, parameters = route
        kwargs = {parameter: data.draw(values) for parameter in parameters}
        try:
            url = reverse(f"admin:{name}", kwargs=kwargs)
        except NoReverseMatch:  # a value its converter cannot carry ("/" in a str, an unknown app label)
            assume(False)
        tried += 1
        status = read_whole(clients[role].get(f"{url}?{urlencode(query)}" if query else url))
        assert status < 500, (role, url, query, status)

    visit()
    assert tried >= EXAMPLES // 3, f"only {tried} admin requests tried of {EXAMPLES}"


def test_every_changelist_action_answers_hostile_selections_without_a_server_error(world):
    _, clients, ids = world
    changelists = [(model, model_admin) for model, model_admin in admin.site._registry.items()]

    @given(role=st.sampled_from(AS), target=st.sampled_from(changelists),
           action=st.one_of(st.sampled_from(["delete_selected", "revoke_selected", "submit_to_gateway",
                                             "killswitch_on", "export"]), hostile_text),
           selected=st.lists(st.one_of(st.sampled_from(ids), hostile_text), max_size=3))
    @hypothesis_settings(max_examples=max(EXAMPLES // 3, 20), deadline=None,
                         suppress_health_check=list(HealthCheck), database=None)
    def act(role: str, target, action: str, selected: list[str]) -> None:
        model, _ = target
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        body = urlencode({"action": action, ACTION_CHECKBOX_NAME: selected, "index": "0"}, doseq=True)
        status = read_whole(clients[role].post(url, body, content_type="application/x-www-form-urlencoded"))
        assert status < 500, (role, url, action, selected, status)

    act()


def test_an_empty_to_field_is_the_primary_key_on_every_change_delete_and_history_page(world):
    """``?_to_field=`` (empty): Django's admin checks a non-empty value against the fields it allows
    and passes an empty one to ``get_field('')`` (FieldDoesNotExist: 500). Found by the fuzzer above
    (``/admin/refundops/merchant/2/delete/?_to_field=``); here every page that reads it, every model."""
    _, clients, _ = world
    client = clients["superuser"]
    tried = 0
    for model, model_admin in admin.site._registry.items():
        first = model._default_manager.order_by("pk").first()
        name = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        for page in ("change", "delete", "history"):
            url = reverse(f"{name}_{page}", args=[quote(first.pk)])
            status = read_whole(client.get(f"{url}?_to_field="))
            assert status < 500, (url, status)
            tried += 1
    assert tried >= 3 * 20

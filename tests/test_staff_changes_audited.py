"""Every change to staff accounts and groups made in the admin is in the audit chain: who made it,
what was before and after (roles, superuser status, permissions, activity), and when. (Issue 9,
finding 1: "users, groups … change with no second person, and several of those changes write no
audit entry". Roles themselves come only from grant_role, audited in test_roles_and_defaults.)"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.hashers import get_hasher
from django.contrib.auth.models import Group, Permission, User
from django.core.management import call_command
from django.test import Client

from audit.models import AuditEntry

pytestmark = pytest.mark.django_db

A_PASSWORD = "correct horse battery staple 42"


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def administrator(username: str = "admin1") -> Client:
    User.objects.create_user(username, password="pw")
    call_command("grant_role", username, "administrator", stdout=open("/dev/null", "w"))
    return signed_in(User.objects.get(username=username))


def entry(action: str, subject_id) -> AuditEntry:
    return AuditEntry.objects.get(action=action, subject_id=str(subject_id))


def no_secrets(data: dict) -> bool:
    text = json.dumps(data)
    # The hasher the run uses too (tests/conftest.py picks a fast one), so its hashes are looked for.
    hashers = {"pbkdf2", "argon2", get_hasher().algorithm}
    return not any(name in text for name in hashers) and A_PASSWORD not in text


def test_an_administrator_adding_and_editing_a_person_is_audited_with_before_and_after():
    client = administrator()
    response = client.post("/admin/auth/user/add/", {"username": "newbie", "password1": A_PASSWORD,
                                                     "password2": A_PASSWORD, "usable_password": "true"})
    assert response.status_code == 302, response.content.decode()[:2000]
    newbie = User.objects.get(username="newbie")
    created = entry("user.created", newbie.pk)
    assert created.actor == "user:admin1"
    assert created.data["username"] == "newbie" and created.data["after"]["is_superuser"] is False
    assert no_secrets(created.data)

    response = client.post(f"/admin/auth/user/{newbie.pk}/change/", {
        "username": "newbie", "first_name": "New", "last_name": "Bie", "email": "new@example.com",
        "is_active": "", "is_staff": "on"})
    assert response.status_code == 302
    changed = entry("user.changed", newbie.pk)
    assert changed.actor == "user:admin1"
    assert changed.data["changes"] == {"first_name": ["", "New"], "last_name": ["", "Bie"],
                                       "email": ["", "new@example.com"], "is_active": [True, False],
                                       "is_staff": [False, True]}


def test_a_superuser_giving_groups_superuser_status_or_a_password_is_audited():
    root = User.objects.create_superuser("root", password="pw")
    target = User.objects.create_user("target", password="pw", is_staff=True)
    finance = Group.objects.get(name="Finance approvers")
    client = signed_in(root)
    response = client.post(f"/admin/auth/user/{target.pk}/change/", {
        "username": "target", "is_active": "on", "is_staff": "on", "is_superuser": "on",
        "groups": [finance.pk], "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"})
    assert response.status_code == 302
    changes = entry("user.changed", target.pk).data["changes"]
    assert changes["is_superuser"] == [False, True]
    assert changes["groups"] == [[], ["Finance approvers"]]

    response = client.post(f"/admin/auth/user/{target.pk}/password/", {
        "password1": A_PASSWORD, "password2": A_PASSWORD, "usable_password": "true"})
    assert response.status_code == 302
    password = entry("user.password_changed", target.pk)
    assert password.actor == "user:root" and password.data == {"username": "target"}


def test_a_superuser_creating_changing_and_deleting_a_group_is_audited():
    client = signed_in(User.objects.create_superuser("root", password="pw"))
    view_refund = Permission.objects.get(codename="view_refund")
    approve = Permission.objects.get(codename="approve_refund")
    assert client.post("/admin/auth/group/add/", {"name": "Night shift", "permissions": [view_refund.pk]}
                       ).status_code == 302
    group = Group.objects.get(name="Night shift")
    created = entry("group.created", group.pk)
    assert created.actor == "user:root"
    assert created.data["after"] == {"name": "Night shift", "permissions": ["refundops.view_refund"]}

    assert client.post(f"/admin/auth/group/{group.pk}/change/", {
        "name": "Night shift", "permissions": [view_refund.pk, approve.pk]}).status_code == 302
    assert entry("group.changed", group.pk).data["changes"] == {
        "permissions": [["refundops.view_refund"], ["refundops.approve_refund", "refundops.view_refund"]]}

    assert client.post(f"/admin/auth/group/{group.pk}/delete/", {"post": "yes"}).status_code == 302
    deleted = entry("group.deleted", group.pk)
    assert deleted.data["before"]["permissions"] == ["refundops.approve_refund", "refundops.view_refund"]


def test_deleting_people_is_audited_one_by_one_also_from_the_list():
    client = signed_in(User.objects.create_superuser("root", password="pw"))
    gone = [User.objects.create_user(f"gone{n}", password="pw") for n in range(3)]
    assert client.post(f"/admin/auth/user/{gone[0].pk}/delete/", {"post": "yes"}).status_code == 302
    assert client.post("/admin/auth/user/", {"action": "delete_selected", "post": "yes",
                                              "_selected_action": [gone[1].pk, gone[2].pk]}).status_code == 302
    assert not User.objects.filter(username__startswith="gone").exists()
    assert sorted(e.data["username"] for e in AuditEntry.objects.filter(action="user.deleted")) == [
        "gone0", "gone1", "gone2"]
    assert set(AuditEntry.objects.filter(action="user.deleted").values_list("actor", flat=True)) == {"user:root"}


def test_a_form_that_saves_nothing_new_writes_no_entry():
    client = administrator()
    target = User.objects.create_user("target", password="pw", is_staff=True, email="t@example.com")
    client.post(f"/admin/auth/user/{target.pk}/change/", {"username": "target", "email": "t@example.com",
                                                          "is_active": "on", "is_staff": "on"})
    assert not AuditEntry.objects.filter(action="user.changed", subject_id=str(target.pk)).exists()

"""Giving a person a role, or taking it away. Each is one transaction with its audit entry."""

from __future__ import annotations

from django.contrib.auth.models import Group
from django.db import transaction

from audit.services import record_audit
from roles.definitions import Role, sync_roles


@transaction.atomic
def grant_role(*, user, role: Role, actor: str) -> None:
    group = Group.objects.filter(name=role.group).first()
    if group is None:  # a database flushed since migrate: the roles come back as defined
        sync_roles()
        group = Group.objects.get(name=role.group)
    user.groups.add(group)
    if not user.is_staff:
        user.is_staff = True  # the admin is where every role works
        user.save(update_fields=["is_staff"])
    record_audit(actor=actor, action="role.granted", subject_type="user", subject_id=str(user.pk),
                 data={"username": user.get_username(), "role": role.name})


@transaction.atomic
def revoke_role(*, user, role: Role, actor: str) -> None:
    user.groups.remove(*Group.objects.filter(name=role.group))
    record_audit(actor=actor, action="role.revoked", subject_type="user", subject_id=str(user.pk),
                 data={"username": user.get_username(), "role": role.name})

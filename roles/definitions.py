"""The five staff roles, least privilege each. A role is a Django group holding exactly the
permissions listed here (``sync_roles``); people get roles with ``manage.py grant_role``.

A control (limits, hold rules, approval authorities, link templates, agent capabilities, merchant
endpoints) is changed only by a proposal that a second person approves (``proposals``); the
``change`` permission of a control's model is the right to propose a change and to approve
someone else's. Stopping things (kill switch, revoking a key or a capability) takes one person.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.apps import apps as global_apps
from django.db.models import Q


@dataclass(frozen=True)
class Role:
    name: str  # as typed to grant_role
    group: str
    does: str
    permissions: tuple[str, ...]  # "app_label.codename"
    views_everything: bool = False


def _perms(spec: dict[str, str]) -> tuple[str, ...]:
    """{"app.model": "view add change"} -> ("app.view_model", "app.add_model", ...)."""
    return tuple(f"{label.split('.')[0]}.{op}_{label.split('.')[1]}" if "_" not in op else f"{label.split('.')[0]}.{op}"
                 for label, ops in spec.items() for op in ops.split())


_MONEY_READ = {"refundops.payment": "view", "refundops.customer": "view", "refundops.refund": "view",
               "refundops.dispute": "view", "audit.verdict": "view", "audit.auditentry": "view",
               "proposals.proposal": "view"}

FINANCE_APPROVER = Role(
    name="finance approver", group="Finance approvers",
    does="decides held refunds, refunds and captures by hand, submits dispute evidence, proposes and "
         "approves limits, link templates and merchant settings, resolves ledger discrepancies",
    permissions=_perms({
        **_MONEY_READ,
        "refundops.refund": "view add approve_refund",
        # change_payment: confirm an authorisation's order amount and capture it;
        # change_disputeevidencedraft: submit an agent's draft evidence to the gateway.
        "refundops.payment": "view change", "refundops.disputeevidencedraft": "view change",
        "refundops.paymentoperation": "view",
        "refundops.paymentlink": "view", "refundops.paymentlinktemplate": "view add change",
        "refundops.refundlimits": "view add change", "refundops.holdrules": "view",
        "refundops.policydraft": "view add change",  # limits drafts (the service checks the kind)
        "approvals.approvalauthority": "view",
        "refundops.merchant": "view change",  # whether a merchant's agents must name their session
        # Reconciliation: read the gateways' books against ours and resolve each difference with a note.
        "refundops.ledgerdiscrepancy": "view resolve_discrepancy",
    }))

FRAUD_ANALYST = Role(
    name="fraud analyst", group="Fraud analysts",
    does="proposes and approves hold rules; reads payments, refunds and verdicts",
    permissions=_perms({**_MONEY_READ, "refundops.holdrules": "view add change", "refundops.refundlimits": "view",
                        "refundops.policydraft": "view add change"}))  # hold-rules drafts

AUDITOR = Role(
    name="auditor", group="Auditors",
    does="reads everything, changes nothing; builds and downloads the evidence pack for a period",
    permissions=("audit.build_evidencepack",), views_everything=True)

OPERATOR = Role(
    name="operator", group="Operators",
    does="kill switch, agents and keys (grants by proposal), gateways and deliveries",
    permissions=_perms({
        "refundops.agent": "view change", "refundops.agentkey": "view change",
        "refundops.platformstate": "view change", "refundops.idempotencyrecord": "view",
        "refundops.webhookdelivery": "view change", "refundops.gatewaycustomer": "view",
        "processors.sandboxcontrol": "view change", "processors.sandboxcharge": "view",
        "processors.sandboxrefund": "view", "processors.inboundevent": "view",
        "audit.auditentry": "view", "proposals.proposal": "view",
    }))

ADMINISTRATOR = Role(
    name="administrator", group="Administrators",
    does="staff accounts, approval authorities and merchant endpoints (each change by proposal)",
    permissions=_perms({
        "auth.user": "view add change", "auth.group": "view",
        "approvals.approvalauthority": "view add change",
        "refundops.merchantendpoint": "view add change", "refundops.webhookdelivery": "view",
        "refundops.agent": "view", "refundops.agentkey": "view",
        "audit.auditentry": "view", "proposals.proposal": "view",
    }))

ROLES: dict[str, Role] = {r.name: r for r in (FINANCE_APPROVER, FRAUD_ANALYST, AUDITOR, OPERATOR, ADMINISTRATOR)}


def find_role(name: str) -> Role:
    key = name.strip().lower().replace("-", " ").replace("_", " ")
    if key not in ROLES:
        raise LookupError(f"No role {name!r}; roles: {', '.join(ROLES)}.")
    return ROLES[key]


def sync_roles(apps=global_apps) -> None:
    """Make each role's group hold exactly its permissions (those that exist)."""
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role in ROLES.values():
        group, _ = Group.objects.get_or_create(name=role.group)
        wanted = Q(codename__startswith="view_") if role.views_everything else Q(pk__in=[])
        for permission in role.permissions:
            app_label, codename = permission.split(".", 1)
            wanted |= Q(content_type__app_label=app_label, codename=codename)
        permissions = Permission.objects.filter(wanted)
        group.permissions.set(permissions)

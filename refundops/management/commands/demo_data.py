"""Fill an empty database with sandbox customers and payments that show every path."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from approvals.models import ApprovalAuthority
from processors import sandbox
from processors.money import Money
from refundops.access import generate_key
from refundops.callers import Caller
from refundops.services.refunds import request_refund
from roles.definitions import find_role
from roles.services import grant_role
from refundops.models import (
    Agent,
    AgentKey,
    Capability,
    Customer,
    Payment,
    PaymentLinkTemplate,
    PlatformState,
    Reason,
    RefundLimits,
)

DEMO_PASSWORD = "refundops-demo"
DEMO_AGENT = "demo-support-bot"
# username: role. Two finance approvers, so a change one proposes has someone to approve it.
STAFF = {"approver": "finance approver", "approver2": "finance approver", "fraud": "fraud analyst",
         "auditor": "auditor", "operator": "operator", "admin": "administrator"}


class Command(BaseCommand):
    help = "Create demo customers, sandbox payments for every path, demo staff and an agent key."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="print ids, logins and the key as JSON")
        parser.add_argument("--if-empty", action="store_true",
                            help="on a database that already has data, say so and succeed without changing it")
        parser.add_argument("--output", type=Path, help="also write the JSON to this file (complete or not at all)")

    def handle(self, *args, as_json: bool = False, if_empty: bool = False, output: Path | None = None, **options):
        if settings.PRODUCTION:
            raise CommandError("demo_data refuses in production mode (REFUNDOPS_ENV=production): it would "
                               "create logins with a published password and an all-capability key.")
        if Payment.objects.exists() or Agent.objects.exists():
            if if_empty:
                self.stderr.write("This database already has data: no demo data added.")
                return
            raise CommandError("demo_data fills an empty database; this one already has payments or agents.")
        with transaction.atomic():
            out = self._create()
        if output is not None:
            write_atomically(output, json.dumps(out, indent=2))
        if as_json:
            self.stdout.write(json.dumps(out, indent=2))
        else:
            self.stdout.write(self.style.SUCCESS("Demo data created."))
            for login in out["staff"]:
                self.stdout.write(f"  {login['role']:16} {login['username']} / {login['password']}")
            self.stdout.write(f"  agent key (shown once): {out['agent']['key']}")

    def _create(self) -> dict:
        now = timezone.now()
        RefundLimits.objects.create(
            currency="USD", version=1, approval_threshold_minor=20_000,
            reason_thresholds={"fraudulent": 5_000}, allowed_reasons=list(Reason.values),
            refund_window_days=60, max_refunds_per_payment=3, customer_daily_count=5,
            customer_daily_amount_minor=100_000, customer_30d_count=20, customer_30d_amount_minor=500_000,
            agent_hourly_amount_minor=200_000, agent_daily_amount_minor=1_000_000,
            session_amount_minor=100_000, global_daily_amount_minor=2_000_000,
            note="Demo limits", created_by="demo_data")
        RefundLimits.objects.create(
            currency="EUR", version=1, approval_threshold_minor=20_000, allowed_reasons=list(Reason.values),
            refund_window_days=60, max_refunds_per_payment=3, customer_daily_count=5,
            customer_daily_amount_minor=100_000, customer_30d_count=20, customer_30d_amount_minor=500_000,
            agent_hourly_amount_minor=200_000, agent_daily_amount_minor=1_000_000,
            session_amount_minor=100_000, global_daily_amount_minor=2_000_000,
            note="Demo limits", created_by="demo_data")
        PlatformState.current()
        sandbox.set_mode("up", settle_delay_seconds=5)

        def customer(name: str, **fields) -> Customer:
            email = name.lower().replace(" ", ".") + "@example.com"
            return Customer.objects.create(name=name, email=email, address=f"1 {name} Street", **fields)

        def pay(label: str, cust: Customer, amount: int, *, currency: str = "USD", days_ago: float = 2,
                captured: bool = True, **fields) -> dict:
            reference = sandbox.open_charge(amount=Money(amount, currency), captured=captured)
            payment = Payment.objects.create(
                customer=cust, processor="sandbox", processor_reference=reference, currency=currency,
                amount_authorized_minor=amount, amount_captured_minor=amount if captured else 0,
                status=Payment.Status.CAPTURED if captured else Payment.Status.AUTHORIZED,
                method_type="card", method_brand="visa", method_last4=f"{4242 + len(label) % 10:04d}"[-4:],
                captured_at=now - timedelta(days=days_ago) if captured else None,
                order_reference=f"ORD-{1000 + Payment.objects.count()}", **fields)
            return {"path": label, "id": payment.pk, "customer_id": cust.pk, "amount": amount,
                    "currency": currency, "status": payment.status}

        payments = [
            pay("fresh capture", customer("Ada Lovelace"), 4_999),
            pay("fresh capture", customer("Grace Hopper"), 12_900),
            pay("fresh capture", customer("Alan Turing"), 2_500),
            pay("fresh capture", customer("Katherine Johnson"), 8_000),
            pay("fresh capture", customer("Edsger Dijkstra"), 15_000),
            pay("fresh capture, above the approval threshold", customer("Barbara Liskov"), 45_000),
            pay("fresh capture in EUR", customer("Tim Berners-Lee"), 3_900, currency="EUR"),
            pay("old capture outside the refund window", customer("Claude Shannon"), 6_000, days_ago=120),
            pay("disputed", customer("John von Neumann"), 7_500, dispute_status=Payment.Dispute.OPEN,
                dispute_reference="dp_demo_open"),
            pay("flagged by fraud", customer("Ken Thompson"), 9_900, fraud_flags=["velocity_anomaly"]),
            pay("recent email change", customer("Dennis Ritchie", email_changed_at=now - timedelta(days=1)), 5_500),
            pay("uncaptured authorisation", customer("Margaret Hamilton"), 3_000, captured=False,
                order_amount_minor=2_800),
            pay("order with an amount owed", customer("Frances Allen"), 10_000, amount_owed_minor=2_500,
                order_amount_minor=12_500),
        ]

        staff = []
        for username, role_name in STAFF.items():
            role = find_role(role_name)
            user = User.objects.create_user(username=username, password=DEMO_PASSWORD, email=f"{username}@example.com")
            grant_role(user=user, role=role, actor="demo_data")
            staff.append({"role": role.name, "username": username, "password": DEMO_PASSWORD, "does": role.does})
        approver = User.objects.get(username="approver")
        for username in ("approver", "approver2"):
            for currency in ("USD", "EUR"):
                ApprovalAuthority.objects.create(user=User.objects.get(username=username), currency=currency,
                                                 max_amount_minor=100_000)

        template = PaymentLinkTemplate.objects.create(
            name="Balance due", approved_by=approver, approved_at=now,
            message="Hi $customer_name, the balance of $amount for order $order_reference is due. "
                    "You can pay it here: $url")
        agent = Agent.objects.create(name=DEMO_AGENT, owner="Customer service",
                                     capabilities=list(Capability.values))
        raw, prefix, digest = generate_key()
        key = AgentKey.objects.create(agent=agent, prefix=prefix, key_hash=digest)
        held = self._held_refunds(Caller.for_key(key), customer, pay)
        return {"payments": payments, "held_refunds": held, "staff": staff, "payment_link_template": template.pk,
                "agent": {"id": agent.pk, "name": agent.name, "capabilities": agent.capabilities,
                          "key": raw, "key_prefix": prefix},
                "limits": {"currency": "USD", "approval_threshold": 20_000, "customer_daily_count": 5,
                           "refund_window_days": 60}}


    @staticmethod
    def _held_refunds(caller: Caller, customer, pay) -> list[dict]:
        """Refunds the agent already asked for that wait for a person, so an approver's first look at
        the queue shows the job: one above the approval threshold, one for a reason with a lower one."""
        asks = [("held: above the approval threshold", customer("Donald Knuth"), 30_000, "customer_request"),
                ("held: fraudulent reason", customer("Radia Perlman"), 8_000, "fraudulent")]
        held = []
        for label, cust, amount, reason in asks:
            payment = pay(label, cust, amount)
            answer = request_refund(caller=caller, idempotency_key=f"demo-{payment['id']}",
                                    data={"transaction_id": payment["id"], "amount": amount, "reason": reason})
            if answer.status != 202:
                raise CommandError(f"demo_data expected the {label!r} refund to be held: {answer.body}")
            held.append({"path": label, "refund_id": answer.body["refund"]["id"], "payment_id": payment["id"]})
        return held


def write_atomically(path: Path, text: str) -> None:
    """The whole file or none of it: a temporary file beside it, renamed over it, removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

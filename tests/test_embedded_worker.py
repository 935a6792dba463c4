"""The worker's moves in embedded mode (SQLite, what `scripts/run` starts without a DATABASE_URL):
settled, declined and canceled over a dispute, each with its history rows in order and an audit
entry whose recorded rows verify. The suite's database is PostgreSQL, so this runs in a process of
its own on a SQLite file; test_scripts_run proves the same end to end, through the sandbox, slowly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import django
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    assert connection.vendor == "sqlite", connection.vendor
    call_command("migrate", verbosity=0)

    from audit.chain import seal, verify_chain
    from audit.models import AuditEntry, Verdict
    from processors.base import RefundResult
    from processors.money import Money
    from refundops.models import Customer, GatewayAttempt, Payment, Refund
    from refundops.services import attempts, payouts
    from django.utils import timezone

    customer = Customer.objects.create(name="C", email="c@example.com")

    def approved(n):
        payment = Payment.objects.create(
            customer=customer, processor="sandbox", processor_reference=f"ch_{n}", currency="USD",
            amount_authorized_minor=5_000, amount_captured_minor=5_000, status=Payment.Status.CAPTURED,
            method_type="card", method_brand="visa", method_last4="4242", captured_at=timezone.now())
        verdict = Verdict.objects.create(operation="refund.create", outcome="approved")
        return Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                     status="approved", verdict=verdict)

    def moves(refund):
        return [(h.status, h.history_change_reason) for h in refund.history.order_by("history_date", "history_id")]

    paid = approved(1)
    attempt = GatewayAttempt.objects.create(refund=paid, idempotency_key=attempts.idempotency_key(paid),
                                            lease_until=timezone.now())
    result = RefundResult(processor_refund_id="sbre_1", status="succeeded", amount=Money(1_000, "USD"))
    paid = payouts.record_gateway_result(refund_id=paid.pk, result=result, attempt=attempt)
    assert paid.status == "settled", paid.status
    assert moves(paid)[-2:] == [("submitted", "system:worker: gateway accepted sbre_1"),
                                ("settled", "system:worker: gateway reported success")], moves(paid)
    assert GatewayAttempt.objects.get(pk=attempt.pk).outcome == "succeeded"

    declined = payouts.record_gateway_failure(refund_id=approved(2).pk, code="card_expired", message="no")
    assert declined.status == "failed", declined.status

    disputed = approved(3)
    Payment.objects.filter(pk=disputed.payment_id).update(dispute_status="open", dispute_reference="dp_1")
    disputed = payouts.cancel_if_disputed_since_approval(refund_id=disputed.pk)
    assert disputed.status == "canceled", disputed.status

    for refund, action in ((paid, "refund.settled"), (declined, "refund.failed"), (disputed, "refund.canceled")):
        entry = AuditEntry.objects.get(action=action, subject_id=refund.pk)
        history = refund.history.order_by("history_date", "history_id").last()
        assert {"model": "refundops.historicalrefund", "pk": history.pk} in [
            {k: r[k] for k in ("model", "pk")} for r in entry.records], entry.records
    seal()
    verdict = list(verify_chain())[-1][2]
    assert verdict == "ok", verdict
    print("EMBEDDED OK")
""")


def test_the_worker_settles_declines_and_cancels_on_sqlite_with_its_audit_entries_verifying(tmp_path):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("DATABASE_URL", "DATABASE_POOL", "DATABASE_POOLER", "TEST_PGBOUNCER")}
    environment.update(DATABASE_URL=f"sqlite:///{tmp_path / 'refundops.sqlite3'}", REFUNDOPS_VAR_DIR=str(tmp_path),
                       DJANGO_SETTINGS_MODULE=os.environ.get("DJANGO_SETTINGS_MODULE", "refundops.settings"))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "EMBEDDED OK" in done.stdout, done.stdout[-3000:] + done.stderr[-5000:]

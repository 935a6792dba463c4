"""What one approved refund costs the database. The statements are pinned so that a regression
shows; the invariants they serve are checked on the same request."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.models import AuditEntry, Verdict
from audit.chain import seal, verify_chain
from bench.wire import on_the_wire
from refundops import outbox
from refundops.celery import app as celery_app
from refundops.models import IdempotencyRecord, OutboxMessage, Refund, RefundState
from refundops.tasks import submit_refund
from tests.conftest import make_payment, post
from tests.test_outbox import queued

pytestmark = pytest.mark.django_db(transaction=True)  # real BEGIN and COMMIT, as in production

# Counted on the wire (bench/wire.py: Django's CaptureQueriesContext counts execute() calls, and one
# may carry several statements), each line a round trip: the key (with the "all agents off"
# switch); BEGIN (psycopg's, a round trip of its own, in pipeline mode too); the idempotency claim;
# the payment lock; limits, hold rules and the drafts running in shadow (one statement, selectors.policy_in_force); SAVEPOINT with the customer's,
# agent's, platform's and currency's locks (one statement, refundops.locks); running totals with
# the kill switch; RELEASE with the refund, once in its final state, and its two history rows
# (requested, then approved) in one statement, the merchant endpoints (read once for both events)
# and the payment's sums; the verdict, the outbox row for the breaker's count, the audit entry (no
# lock: sealed after the commit), the outbox row for the submission and the stored answer (the
# writes nothing reads before the commit, refundops.batching: sent as the block leaves psycopg's
# pipeline, and their callbacks run before the COMMIT, issue 30); COMMIT. Nothing after the commit:
# the request hands both rows to the process's outbox sender, which claims them and marks them sent
# (two statements) on its own connection, in its own thread (refundops/outbox.py); under eager
# tasks they would still be the request's. The submission is routed by the payment's processor,
# without a query.
APPROVED_REFUND_ROUND_TRIPS = 10
APPROVED_REFUND_STATEMENTS = 18


def test_an_approved_refund_takes_10_round_trips_of_18_statements_and_keeps_every_invariant(api, policy, monkeypatch):
    monkeypatch.setitem(celery_app.conf, "task_always_eager", False)  # as deployed: the breaker's count to Redis
    # The key's first use is stamped and the platform row made once; neither is the steady state.
    post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100, "reason": "duplicate"})
    payment = make_payment(amount=5_000)

    with on_the_wire(connection) as wire:
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                                 "reason": "customer_request", "agent": {"session_id": "s1"}})

    sent_sql = "\n".join(" ;".join(text[:60] for text in trip) for trip in wire.trips)
    assert (wire.round_trips, wire.statements) == (APPROVED_REFUND_ROUND_TRIPS, APPROVED_REFUND_STATEMENTS), sent_sql
    assert response.status_code == 201
    assert outbox.drain(timeout=30)
    body = response.json()
    refund = Refund.objects.get(pk=body["refund"]["id"])
    assert refund.status == RefundState.APPROVED and refund.verdict_id == body["verdict"]["id"]
    verdict = Verdict.objects.get(pk=refund.verdict_id)
    assert (verdict.outcome, verdict.refund_id, verdict.totals["payment_refund_count"]) == ("approved", refund.pk, 0)
    payment.refresh_from_db()
    assert (payment.amount_reserved_minor, payment.amount_refunded_minor) == (1_250, 0)
    record = IdempotencyRecord.objects.get(scope=api.key.agent_id, response_body__refund__id=refund.pk)
    assert record.response_status == 201
    assert AuditEntry.objects.filter(action="refund.approved", subject_id=refund.pk).exists()
    assert list(verify_chain())[-1][2] == "ok"
    assert {"task": submit_refund.name, "kwargs": {"refund_id": refund.pk}} in queued("payments.sandbox")
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()  # both effects sent after commit


# The worker paying one approved refund on the sandbox (settle delay zero), counted on the wire, each
# line a round trip: the refund and its payment read; BEGIN; the payment's lock; the refund's (the
# payment named by the refund just read); the attempts not yet finished (one query: a live lease or
# an unknown answer); the attempt; COMMIT; the sandbox's own two (its control row; the charge's
# refunded total raised and its refund inserted in one statement; eight before: its key looked up,
# BEGIN, the charge locked, the key again under it, the charge, its refund, COMMIT); BEGIN; the two
# locks (the refund's without its payment again); the refund saved once in its last state (settled),
# the columns that changed; the history rows of both moves (submitted, settled) in one INSERT with
# the merchant endpoints, read once for both; the attempt closed with the attempts the gateway's news
# resolves (one UPDATE) with the payment's sums; the verdict's gateway answer, returning the verdict
# the audit entry vouches for (with the history row just written, not read back); the audit entry;
# COMMIT. The answer's writes that nothing reads before the commit ride with the next statement
# (psycopg's pipeline, refundops.batching): Django's CaptureQueriesContext sees 17 execute() calls.
# (32 statements before issue 31: each move saved, its history row written and the endpoints read,
# and the history row and verdict read back for the audit entry; then 26 in 26 round trips until
# the sandbox's one statement, 20 in 20 until the answer's batch.)
WORKER_SETTLE_ROUND_TRIPS = 18
WORKER_SETTLE_STATEMENTS = 20
WORKER_SETTLE_EXECUTES = 17


def test_the_worker_settles_an_approved_refund_in_18_round_trips_of_20_statements_and_pays_it_once(api, policy, monkeypatch):
    from processors import sandbox
    from processors.models import SandboxRefund
    from refundops.models import GatewayAttempt
    from refundops.services import payouts

    monkeypatch.setattr(submit_refund, "apply_async", lambda **options: None)
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250, "reason": "duplicate"})
    refund_id = response.json()["refund"]["id"]
    connection.close()  # a fresh connection, as a worker's task starts with

    with CaptureQueriesContext(connection) as queries, on_the_wire(connection) as wire:
        refund = payouts.submit_refund(refund_id=refund_id)

    sent_sql = "\n".join(" ;".join(text[:60] for text in trip) for trip in wire.trips)
    assert (wire.round_trips, wire.statements) == (WORKER_SETTLE_ROUND_TRIPS, WORKER_SETTLE_STATEMENTS), sent_sql
    assert len(queries) == WORKER_SETTLE_EXECUTES, "\n".join(q["sql"][:100] for q in queries)
    assert refund.status == RefundState.SETTLED
    (paid,) = SandboxRefund.objects.filter(metadata__refund_id=refund_id)
    assert (paid.amount_minor, paid.reference) == (1_250, refund.processor_refund_id)
    assert list(GatewayAttempt.objects.filter(refund_id=refund_id).values_list("outcome", flat=True)) == ["succeeded"]
    payment.refresh_from_db()
    assert (payment.amount_reserved_minor, payment.amount_refunded_minor) == (0, 1_250)
    assert AuditEntry.objects.filter(action="refund.settled", subject_id=refund_id).exists()
    history = list(refund.history.order_by("history_date", "history_id").values_list("status", "history_change_reason"))
    assert [status for status, _ in history] == ["requested", "approved", "submitted", "settled"]  # one row a move
    assert history[-2:] == [("submitted", f"system:worker: gateway accepted {refund.processor_refund_id}"),
                            ("settled", "system:worker: gateway reported success")]
    seal()  # sealed entries' recorded rows are checked against the rows as stored
    assert list(verify_chain())[-1][2] == "ok"  # the history row and verdict as written, digests and all


@pytest.mark.django_db
def test_the_tables_every_refund_writes_carry_no_prefix_search_twins():
    # Django gives each indexed CharField on PostgreSQL a varchar_pattern_ops twin for LIKE 'x%';
    # nothing searches these columns by prefix, and an approved refund wrote 22 entries into them
    # (migration 0017). Equality keeps its plain index.
    columns = importlib.import_module("refundops.migrations.0017_drop_pattern_ops_twins").COLUMNS
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = ANY(%s)"
                       " AND indexdef ~ '(varchar|text)_pattern_ops'", [list(columns)])
        assert cursor.fetchall() == []
        cursor.execute("SELECT tablename, indexdef FROM pg_indexes WHERE tablename = ANY(%s)", [list(columns)])
        plain = {(table, definition.rsplit("(", 1)[1].rstrip(")")) for table, definition in cursor.fetchall()}
    assert {(table, column) for table, names in columns.items() for column in names} <= plain
    assert sum(map(len, columns.values())) == 17  # every twin of the four tables, none left out

"""Fault harness: a few hundred refunds end to end while workers die, gateways stall and Redis restarts.

    .venv/bin/python bench/chaos.py [--refunds 300] [--faults 30] [--seed 1] [--workers 2] [--json]
    scripts/chaos …                  # the same, after scripts/services and scripts/install

Real parts only: a PostgreSQL database of its own (``<DATABASE_URL's name or refundops_<checkout>>_chaos``,
recreated and migrated), a private ``redis-server`` on a free port (never the machine's shared one),
``celery -A refundops worker`` subprocesses on every queue, the fake Stripe from tests/fakes on a
socket (driven by the official SDK through our adapter) and the sandbox gateway. Refunds are asked
through ``services.refunds.request_refund`` as an agent, several partial refunds per payment racing
each other; between faults the harness runs what beat would (sweep, sync, outbox relay when there
is one) with short thresholds (``bench/settings_chaos.py``).

Faults, each counted: ``worker_kill`` (SIGKILL a worker's process group mid-work, start a new one),
``gateway_timeout_after_acting`` (the fake Stripe acts, then answers after the client gave up),
``duplicate_submission`` (the same refund submitted from several workers at once, and the same
gateway request sent twice at once: Stripe answers the second 409 "key in use", the sandbox may
decline it), ``webhook_twice`` (the gateway's signed event posted twice at once to
``/webhooks/stripe/``), ``webhook_lost`` (never posted: the sync must find it),
``gateway_unreachable`` (the fake Stripe drops connections; the sandbox is down),
``redis_restart`` (the private Redis killed and started empty: queued tasks are lost),
``merchant_down`` (the merchant's endpoint answers 503 for a while).

Then, once faults stop and everything drains (with a deadline), the invariant check: per payment
the gateway's refunded total equals our settled total and our counting total never exceeds the
capture; no refund of ours has two gateway refunds; no refund is left approved or submitted; every
committed refund state change reached the merchant's endpoint; ``manage.py reconcile --json`` finds
nothing. Prints the counts (``--json``: one object) and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # run as a script: the project (and its tests.fakes) first
from bench.stack import (  # noqa: E402 - after the path is set
    PrivateRedis,
    Workers,
    create_migrated_database,
    drop_database,
)

SETTINGS = "bench.settings_chaos"
STRIPE_KEY = "sk_test_chaos"
STRIPE_WEBHOOK_SECRET = "whsec_chaos_harness"
# What the merchant's endpoint subscribes to with --events money: a refund approved, and how it ended.
MONEY_EVENTS = ("refund.approved", "refund.settled", "refund.failed", "refund.canceled")
FAULT_KINDS = ("worker_kill", "gateway_timeout_after_acting", "duplicate_submission", "webhook_twice",
               "webhook_lost", "gateway_unreachable", "redis_restart", "merchant_down")


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the real parts ---------------------------------------------------------------------------------

def database_url() -> str:
    """This checkout's database (as scripts/test names it), or DATABASE_URL's, with ``_chaos`` added."""
    base = os.environ.get("DATABASE_URL") or (
        "postgres://postgres@127.0.0.1:5432/refundops_" + hashlib.sha1(str(ROOT).encode()).hexdigest()[:8])
    parts = urlsplit(base)
    name = parts.path.lstrip("/") or "refundops"
    return urlunsplit(parts._replace(path=f"/{name}_chaos"))


class MerchantReceiver:
    """The merchant's endpoint: records every event id it was sent; answers 503 while ``down``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: collections.Counter[str] = collections.Counter()
        self.down = False
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.down:
                    self.send_response(503)
                    self.end_headers()
                    return
                with receiver.lock:
                    receiver.received[json.loads(body)["id"]] += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/refund-events"


# -- the run ----------------------------------------------------------------------------------------

@dataclass
class Report:
    seed: int
    refunds_asked: int = 0
    refunds_by_status: dict[str, int] = field(default_factory=dict)
    payments: int = 0
    faults: collections.Counter = field(default_factory=collections.Counter)
    faults_planned: int = 0
    gateway_effects: collections.Counter = field(default_factory=collections.Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    drained: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    reconcile: dict[str, Any] = field(default_factory=dict)
    outbox: bool = False
    deliveries: int = 0

    def violation(self, kind: str, **detail: Any) -> None:
        self.violations.append({"kind": kind, **detail})

    def as_json(self) -> dict[str, Any]:
        by_kind = collections.Counter(v["kind"] for v in self.violations)
        return {"seed": self.seed, "payments": self.payments, "refunds_asked": self.refunds_asked,
                "refunds": sum(self.refunds_by_status.values()), "refunds_by_status": self.refunds_by_status,
                "faults": sum(self.faults.values()), "faults_by_kind": dict(sorted(self.faults.items())),
                "gateway_effects": dict(sorted(self.gateway_effects.items())), "outbox": self.outbox,
                "merchant_deliveries": self.deliveries,
                "drained": self.drained, "violations": len(self.violations),
                "violations_by_kind": dict(by_kind), "violation_details": self.violations[:50],
                "reconcile": self.reconcile, "seconds": {k: round(v, 1) for k, v in self.seconds.items()}}


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.report = Report(seed=args.seed, faults_planned=args.faults)
        self.kinds = [k for k in FAULT_KINDS if k in set(args.kinds.split(","))] if args.kinds else list(FAULT_KINDS)
        self.workdir = Path(tempfile.mkdtemp(prefix="refundops-chaos-"))
        self.redis = PrivateRedis(self.workdir)
        self.stop = threading.Event()
        self.faults_over = threading.Event()
        self.lock = threading.Lock()
        self.webhook_mode = collections.deque()  # what the next settled Stripe refunds' webhooks suffer
        self.workers: Workers | None = None

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        started = time.monotonic()
        self.db_url = database_url()
        self.redis.start()
        from tests.fakes.stripe_server import FakeStripe

        self.stripe = FakeStripe(api_key=STRIPE_KEY).start()
        self.stripe.next_refund_status = "pending"  # settled later, by webhook or by our sync
        self.stripe.slow_seconds = self.args.gateway_timeout * 2
        self.merchant = MerchantReceiver()
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "DATABASE_URL": self.db_url,
                    "REDIS_URL": self.redis.url, "REDIS_KEY_PREFIX": "chaos:", "CELERY_TASK_ALWAYS_EAGER": "false",
                    "CHAOS_STRIPE_API_BASE": self.stripe.url, "CHAOS_STRIPE_API_KEY": STRIPE_KEY,
                    "CHAOS_STRIPE_WEBHOOK_SECRET": STRIPE_WEBHOOK_SECRET,
                    "CHAOS_GATEWAY_TIMEOUT": str(self.args.gateway_timeout), "PYTHONUNBUFFERED": "1"}
        create_migrated_database(self.db_url, self.env)
        os.environ.update(self.env)
        import django

        django.setup()
        import logging

        from django.conf import settings

        # The harness's own process stays quiet (faults make the product log a lot); workers log to files.
        logging.getLogger("refundops").setLevel(logging.ERROR if self.args.verbose else logging.CRITICAL)

        self.workers = Workers(self.args.workers, self.env, self.workdir, list(settings.CELERY_WORKER_QUEUES))
        self.workers.start_all()
        self.seed_data()
        self.report.seconds["setup"] = time.monotonic() - started

    def seed_data(self) -> None:
        from processors import sandbox
        from processors.money import Money
        from refundops.callers import Caller
        from refundops.models import MerchantEndpoint, Payment
        from tests.conftest import make_agent_key, make_customer, make_limits, make_rules

        make_limits()
        make_rules()
        sandbox.set_mode("up", settle_delay_seconds=0)  # paid when accepted; Stripe's settle later, by webhook
        key, _ = make_agent_key(name="chaos-agent")
        self.caller = Caller.for_key(key)
        MerchantEndpoint.objects.create(url=self.merchant.url, description="chaos harness receiver",
                                        event_types=[] if self.args.events == "all" else list(MONEY_EVENTS))
        # Payments enough for --refunds asks at 2..4 partial refunds each, half on each gateway.
        self.plan: list[tuple[Any, list[int]]] = []
        asked = 0
        while asked < self.args.refunds:
            k = min(self.rng.randint(2, 4), self.args.refunds - asked)
            amount = self.rng.randrange(2_000, 20_000, 100)
            customer = make_customer()
            common = dict(customer=customer, currency="USD", amount_authorized_minor=amount,
                          amount_captured_minor=amount, status=Payment.Status.CAPTURED, method_type="card",
                          method_brand="visa", method_last4="4242")
            from django.utils import timezone

            if len(self.plan) % 2:
                reference = self.stripe.add_payment_intent(amount, "usd")
                payment = Payment.objects.create(processor="stripe", processor_reference=reference,
                                                 captured_at=timezone.now(), **common)
            else:
                reference = sandbox.open_charge(amount=Money(amount, "USD"))
                payment = Payment.objects.create(processor="sandbox", processor_reference=reference,
                                                 captured_at=timezone.now(), **common)
            # Partial refunds that sometimes ask for more than is left: the ledger must refuse those.
            shares = [max(100, int(amount / k * self.rng.uniform(0.4, 1.25)) // 100 * 100) for _ in range(k)]
            self.plan.append((payment, shares))
            asked += k
        self.report.payments = len(self.plan)
        self.report.refunds_asked = asked

    def effect(self, what: str, exc: BaseException | None = None) -> None:
        """Count what the product or the gateway did under a fault; log the first of each kind."""
        with self.lock:
            self.report.gateway_effects[what] += 1
            first = self.report.gateway_effects[what] == 1
        if first and exc is not None:
            log(f"{what}: {exc!r}"[:500])

    # -- driving refunds --------------------------------------------------------------------------
    def ask(self, payment_id: str, amount: int) -> None:
        """One agent's refund ask, retried with the same idempotency key while the answer is lost."""
        from django.db import connection

        from refundops.services.refunds import request_refund

        key = uuid.uuid4().hex
        data = {"transaction_id": payment_id, "amount": amount, "reason": "customer_request"}
        try:
            raised = False
            for attempt in range(60):
                try:
                    answer = request_refund(caller=self.caller, data=data, idempotency_key=key)
                except Exception as exc:  # a lost answer (e.g. the broker away at commit): ask again
                    self.effect(f"ask_raised:{type(exc).__name__}", exc)
                    raised = True
                    time.sleep(0.2 + 0.05 * attempt)
                    continue
                if raised and answer.body.get("deduplicated"):
                    # An error to the caller for a refund that had committed: the finding 2.
                    with self.lock:
                        self.report.violation("committed_request_answered_error", payment=payment_id,
                                              refund=(answer.body.get("refund") or {}).get("id"), status=answer.status)
                return
        finally:
            connection.close()

    def drive(self, seconds: float) -> None:
        """Each payment's partial refunds asked at once, the payments spread over ``seconds``."""
        gap = seconds / max(len(self.plan), 1)
        threads: list[threading.Thread] = []
        for payment, shares in self.plan:
            for amount in shares:
                thread = threading.Thread(target=self.ask, args=(payment.pk, amount), daemon=True)
                thread.start()
                threads.append(thread)
            time.sleep(gap)
            threads = [t for t in threads if t.is_alive()]
        for thread in threads:
            thread.join(timeout=60)

    # -- what beat would run, and the gateway's own clock ---------------------------------------------
    def periodic(self) -> None:
        from django.db import connection

        from refundops import tasks

        # Beat's jobs that keep refunds and their webhooks moving, each where this checkout has it.
        optional = [(every, getattr(tasks, name)) for every, name in
                    ((2.0, "relay_outbox"), (2.0, "deliver_overdue_webhooks")) if hasattr(tasks, name)]
        self.report.outbox = hasattr(tasks, "relay_outbox")
        jobs = [(2.0, lambda: tasks.resubmit_stalled_refunds(older_than_seconds=3)),
                (5.0, lambda: tasks.sync_submitted_refunds(older_than_seconds=5)), *optional]
        due = [0.0] * len(jobs)
        while not self.stop.is_set():
            for i, (every, job) in enumerate(jobs):
                if time.monotonic() < due[i]:
                    continue
                due[i] = time.monotonic() + every
                try:
                    job()
                except Exception as exc:  # the broker away: beat's next tick tries again
                    self.effect(f"periodic_raised:{type(exc).__name__}", exc)
            connection.close()
            self.stop.wait(0.5)

    def stripe_clock(self) -> None:
        """The fake Stripe settles pending refunds after a moment and tells us by a signed webhook,
        posted once, twice at once (``webhook_twice``), or never (``webhook_lost``)."""
        from django.db import connection
        from django.test import Client

        from tests.fakes.fixtures import post_stripe_event, stripe_event

        while not self.stop.is_set():
            now = time.time()
            with self.stripe.lock:
                due = [r["id"] for r in self.stripe.refunds.values()
                       if r["status"] == "pending" and r["created"] <= now - 1]
            for refund_id in due:
                self.stripe.set_refund_status(refund_id, "succeeded")
                with self.stripe.lock:
                    obj = json.loads(json.dumps(self.stripe.refunds[refund_id]))
                event = stripe_event("charge.refund.updated", obj)
                with self.lock:
                    mode = self.webhook_mode.popleft() if self.webhook_mode else "once"
                if mode == "lost":
                    continue
                posts = 2 if mode == "twice" else 1
                answers = []

                def post() -> None:
                    for _ in range(30):  # Stripe retries until it gets a 2xx
                        try:
                            status = post_stripe_event(Client(), event, secret=STRIPE_WEBHOOK_SECRET).status_code
                        except Exception:
                            status = 599
                        finally:
                            connection.close()
                        if 200 <= status < 300:
                            answers.append(status)
                            return
                        time.sleep(0.3)

                senders = [threading.Thread(target=post, daemon=True) for _ in range(posts)]
                for sender in senders:
                    sender.start()
                for sender in senders:
                    sender.join(timeout=30)
            connection.close()
            self.stop.wait(0.3)

    # -- faults -----------------------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        from processors import sandbox

        args = self.args
        if kind == "worker_kill":
            slot = self.rng.randrange(len(self.workers.procs))
            self.workers.kill(slot)
            time.sleep(self.rng.uniform(0, 0.5))
            self.workers.start(slot)
        elif kind == "gateway_timeout_after_acting":
            self.stripe.set_mode("slow_after", slow_seconds=args.gateway_timeout * 2)
            time.sleep(self.rng.uniform(1.0, 2.0))
            self.stripe.set_mode("up")
        elif kind == "duplicate_submission":
            self.duplicate_submission()
        elif kind in ("webhook_twice", "webhook_lost"):
            with self.lock:
                self.webhook_mode.extend(["twice" if kind == "webhook_twice" else "lost"] * self.rng.randint(1, 3))
        elif kind == "gateway_unreachable":
            self.stripe.set_mode("unreachable")
            sandbox.set_mode("down")
            time.sleep(self.rng.uniform(0.5, 1.5))
            self.stripe.set_mode("up")
            sandbox.set_mode("up")
        elif kind == "redis_restart":
            self.redis.kill()
            time.sleep(self.rng.uniform(0.2, 1.0))
            self.redis.start()
        elif kind == "merchant_down":
            self.merchant.down = True
            time.sleep(self.rng.uniform(0.5, 2.0))
            self.merchant.down = False
        self.report.faults[kind] += 1

    def duplicate_submission(self) -> None:
        """The same refund submitted by several workers at once (a redelivered task, a sweep, a retry),
        and its very gateway request sent twice at once (a zombie call): only one may pay."""
        from django.db import connection

        from processors.base import RefundRequest
        from processors.registry import get_processor
        from refundops import tasks
        from refundops.models import Refund, RefundState
        from refundops.services import attempts, payouts

        # Rather a refund nothing has called the gateway for yet: then the racers really meet there.
        fresh = Refund.objects.filter(status=RefundState.APPROVED, attempts__isnull=True)
        candidates = list(fresh.select_related("payment").order_by("-created_at")[:20]) or list(
            Refund.objects.filter(status__in=(RefundState.APPROVED, RefundState.SUBMITTED))
            .select_related("payment").order_by("-created_at")[:20])
        connection.close()
        if not candidates:
            return
        # The largest of them: the likeliest not to fit twice, so a sandbox that let both in would decline one.
        refund = max(self.rng.sample(candidates, min(3, len(candidates))), key=lambda r: r.amount_minor)
        racers = 3 if self.args.gateway_duplicates else 2
        start = threading.Barrier(racers)

        def submit() -> None:
            try:
                start.wait(timeout=10)
                payouts.submit_refund(refund_id=refund.pk)
                self.effect("duplicate:returned")
            except Exception as exc:  # RetryLater, unavailable: the product said "not now"
                self.effect(f"duplicate:{type(exc).__name__}")
            finally:
                connection.close()

        def replay_at_gateway() -> None:
            processor = get_processor(refund.payment.processor, refund.payment.processor_account)
            request = RefundRequest(payment=payouts.payment_ref(refund.payment), amount=refund.money,
                                    reason=refund.reason, idempotency_key=attempts.idempotency_key(refund),
                                    refund_id=refund.pk, verdict_id=refund.verdict_id or "")
            try:
                start.wait(timeout=10)
                processor.refund(request)
                outcome = "accepted"
            except Exception as exc:
                outcome = getattr(exc, "code", type(exc).__name__)
            finally:
                connection.close()
            self.effect(f"gateway_duplicate:{refund.payment.processor}:{outcome}")

        for _ in range(2):  # and the same refund's task twice more, to the workers
            try:
                tasks.submit_refund.delay(refund_id=refund.pk)
            except Exception:
                pass
        threads = [threading.Thread(target=fn, daemon=True)
                   for fn in [submit, submit, replay_at_gateway][:racers]]
        stripe = refund.payment.processor == "stripe"
        if stripe:  # the first request holds its key a while: Stripe answers the other 409 "key in use"
            self.stripe.set_mode("slow_after", slow_seconds=self.args.gateway_timeout * 2)
        for thread in threads:
            thread.start()
        if stripe:
            time.sleep(0.5)  # the racers are in; everyone else's requests go on as usual
            self.stripe.set_mode("up")
        for thread in threads:
            thread.join(timeout=30)

    def fault_loop(self, seconds: float) -> None:
        """``--faults`` faults, the kinds in turn and shuffled, at random moments of the run (one at
        a time: a fault that takes a while pushes the next one later)."""
        plan = [self.kinds[i % len(self.kinds)] for i in range(self.args.faults)]
        self.rng.shuffle(plan)
        moments = sorted(self.rng.uniform(0, seconds * 0.9) for _ in plan)
        start = time.monotonic()
        for kind, moment in zip(plan, moments):
            time.sleep(max(0.0, start + moment - time.monotonic()))
            try:
                self.inject(kind)
            except Exception as exc:
                log(f"fault {kind} could not be injected: {exc!r}")
        self.faults_over.set()

    # -- drain and check ---------------------------------------------------------------------------
    def restore(self) -> None:
        from processors import sandbox

        self.stripe.set_mode("up")
        sandbox.set_mode("up")
        self.merchant.down = False
        if self.redis.proc is None:
            self.redis.start()
        self.workers.ensure_running()

    def outstanding(self) -> dict[str, int]:
        from django.db import connection

        from refundops.models import GatewayAttempt, Refund, RefundState, WebhookDelivery

        counts = {
            "refunds_in_flight": Refund.objects.filter(
                status__in=(RefundState.REQUESTED, RefundState.APPROVED, RefundState.SUBMITTED)).count(),
            "attempts_unresolved": GatewayAttempt.objects.filter(outcome__in=("live", "unknown")).count(),
            "deliveries_pending": WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING).count(),
        }
        with self.stripe.lock:
            counts["stripe_pending"] = sum(r["status"] == "pending" for r in self.stripe.refunds.values())
        connection.close()
        return counts

    def drain(self) -> None:
        started = time.monotonic()
        deadline = started + self.args.drain_seconds
        last: dict[str, int] = {}
        while time.monotonic() < deadline:
            self.workers.ensure_running()  # a worker killed last stays dead otherwise
            last = self.outstanding()
            if not any(last.values()):
                self.report.drained = True
                break
            if int(time.monotonic() - started) % 10 == 0:
                log(f"draining: {last}")
            time.sleep(1.0)
        self.report.seconds["drain"] = time.monotonic() - started
        if not self.report.drained:
            self.report.violation("not_drained", outstanding=last)

    def check(self) -> None:
        from django.db import connection
        from django.db.models import Sum

        from processors.registry import get_processor
        from refundops.models import (
            GatewayAttempt,
            LedgerDiscrepancy,
            Payment,
            Refund,
            RefundState,
            WebhookDelivery,
        )
        from refundops.services.payouts import payment_ref

        report = self.report
        report.refunds_by_status = dict(collections.Counter(Refund.objects.values_list("status", flat=True)))
        for payment in Payment.objects.order_by("pk"):
            ours = list(payment.refunds.all())
            settled = sum(r.amount_minor for r in ours if r.status == RefundState.SETTLED)
            counting = (payment.refunds.filter(status__in=(RefundState.APPROVED, RefundState.SUBMITTED,
                                                           RefundState.SETTLED, RefundState.HELD))
                        .aggregate(total=Sum("amount_minor"))["total"] or 0)
            if counting > payment.amount_captured_minor:
                report.violation("refunded_more_than_captured", payment=payment.pk, counting=counting,
                                 captured=payment.amount_captured_minor)
            book = get_processor(payment.processor, payment.processor_account).fetch_payment_book(payment_ref(payment))
            moved = [g for g in book.refunds if g.status in ("pending", "succeeded")]
            theirs = sum(g.amount.amount_minor for g in moved)
            if theirs != settled:
                report.violation("gateway_total_differs", payment=payment.pk, gateway=payment.processor,
                                 gateway_refunded=theirs, ours_settled=settled,
                                 ours=[(r.pk, r.status, r.amount_minor, r.processor_refund_id) for r in ours],
                                 theirs=[(g.processor_refund_id, g.status, g.amount.amount_minor, g.our_refund_id)
                                         for g in book.refunds])
            per_refund = collections.Counter(g.our_refund_id for g in moved)
            for refund_id, n in per_refund.items():
                if n > 1:
                    report.violation("paid_twice", payment=payment.pk, refund=refund_id, gateway_refunds=n)
                if refund_id not in {r.pk for r in ours}:
                    report.violation("gateway_refund_not_ours", payment=payment.pk, refund=refund_id)
        for refund in Refund.objects.filter(status__in=(RefundState.REQUESTED, RefundState.APPROVED,
                                                        RefundState.SUBMITTED)):
            report.violation("stuck", refund=refund.pk, status=refund.status)
        # Every committed state change announced, and the merchant got it.
        delivered: dict[str, set[str]] = collections.defaultdict(set)
        report.deliveries = WebhookDelivery.objects.count()
        for delivery in WebhookDelivery.objects.all():
            refund_id = delivery.payload["data"]["object"]["id"]
            if delivery.status != WebhookDelivery.Status.DELIVERED:
                report.violation("webhook_not_delivered", delivery=delivery.pk, refund=refund_id,
                                 event=delivery.event_type, status=delivery.status, last_error=delivery.last_error[:200])
            elif delivery.event_id not in self.merchant.received:
                report.violation("webhook_not_received", delivery=delivery.pk, event=delivery.event_type)
            delivered[refund_id].add(delivery.event_type)
        for refund in Refund.objects.all():
            states = set(refund.history.values_list("status", flat=True))
            wanted = {f"refund.{s}" for s in states}
            if self.args.events != "all":
                wanted &= set(MONEY_EVENTS)
            missing = wanted - delivered[refund.pk]
            if missing:
                report.violation("state_change_unannounced", refund=refund.pk, missing=sorted(missing))
        for attempt in GatewayAttempt.objects.filter(outcome__in=("live", "unknown")).select_related("refund"):
            report.violation("attempt_unresolved", refund=attempt.refund_id, refund_status=attempt.refund.status,
                             outcome=attempt.outcome, error=attempt.error_code)
        for found in LedgerDiscrepancy.objects.filter(status=LedgerDiscrepancy.Status.OPEN):
            report.violation("discrepancy_raised", kind_found=found.kind, payment=found.payment_id,
                             refund=found.refund_id, detail=found.detail[:300])
        connection.close()
        self.run_reconcile()

    def run_reconcile(self) -> None:
        answer = subprocess.run([sys.executable, "manage.py", "reconcile", "--json"], cwd=ROOT, env=self.env,
                                capture_output=True, text=True, timeout=300)
        try:
            body = json.loads(answer.stdout)
        except ValueError:
            body = {"stdout": answer.stdout[-2000:], "stderr": answer.stderr[-2000:]}
        self.report.reconcile = {"exit": answer.returncode, "checked": body.get("checked"),
                                 "discrepancies": len(body.get("discrepancies") or []),
                                 "recorded": len(body.get("recorded") or []),
                                 "unreachable": len(body.get("unreachable") or [])}
        if answer.returncode != 0 or body.get("discrepancies") or body.get("recorded") or body.get("unreachable"):
            self.report.violation("reconcile_reports", exit=answer.returncode,
                                  discrepancies=(body.get("discrepancies") or [])[:10],
                                  recorded=body.get("recorded"), unreachable=body.get("unreachable"),
                                  error=body.get("stderr", "")[-500:] if "stderr" in body else "")

    # -- the whole run ------------------------------------------------------------------------------
    def run(self) -> Report:
        started = time.monotonic()
        try:
            self.setup()
            log(f"{self.report.payments} payments, {self.report.refunds_asked} refunds to ask, "
                f"{self.args.faults} faults of {', '.join(self.kinds)}; workdir {self.workdir}")
            background = [threading.Thread(target=self.periodic, daemon=True),
                          threading.Thread(target=self.stripe_clock, daemon=True)]
            for thread in background:
                thread.start()
            phase = time.monotonic()
            seconds = self.args.seconds or max(15.0, self.report.refunds_asked / 8)
            faults = threading.Thread(target=self.fault_loop, args=(seconds,), daemon=True)
            faults.start()
            self.drive(seconds)
            faults.join()
            self.report.seconds["faults"] = time.monotonic() - phase
            self.restore()
            self.drain()
            self.stop.set()
            for thread in background:
                thread.join(timeout=30)
            self.check()
        finally:
            self.stop.set()
            self.teardown()
            self.report.seconds["total"] = time.monotonic() - started
        return self.report

    def teardown(self) -> None:
        if self.workers is not None:
            self.workers.stop_all()
        self.redis.kill()
        if getattr(self, "stripe", None) is not None:
            self.stripe.stop()
        if getattr(self, "merchant", None) is not None:
            self.merchant.server.shutdown()
        if not self.args.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            if getattr(self, "db_url", None):  # the migrated template stays, for the next run
                drop_database(self.db_url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refunds", type=int, default=300, help="refund asks (several per payment, racing)")
    parser.add_argument("--faults", type=int, default=30, help="faults to inject while refunds are asked")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3, help="celery worker processes (4 threads each)")
    parser.add_argument("--seconds", type=float, default=0, help="how long to ask and inject (default: refunds/8, at least 15)")
    parser.add_argument("--drain-seconds", type=float, default=90, help="deadline for everything to settle afterwards")
    parser.add_argument("--gateway-timeout", type=float, default=1.5, help="the Stripe client's timeout, seconds")
    parser.add_argument("--kinds", default="", help=f"comma-separated subset of {','.join(FAULT_KINDS)}")
    parser.add_argument("--no-gateway-duplicates", dest="gateway_duplicates", action="store_false",
                        help="duplicate_submission only races our workers, never sends the gateway request twice")
    parser.add_argument("--events", choices=("all", "money"), default="all",
                        help="what the merchant's endpoint subscribes to: every state, or " + ", ".join(MONEY_EVENTS))
    parser.add_argument("--keep", action="store_true", help="keep the work directory (worker logs) and the database")
    parser.add_argument("--verbose", action="store_true", help="the product's errors in this process too")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = Harness(args).run().as_json()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"refunds: {report['refunds']} of {report['refunds_asked']} asked on {report['payments']} payments "
              f"{report['refunds_by_status']}")
        print(f"faults: {report['faults']} {report['faults_by_kind']}")
        print(f"gateway/product effects: {report['gateway_effects']}")
        print(f"merchant webhook deliveries: {report['merchant_deliveries']}; reconcile: {report['reconcile']}")
        print(f"violations: {report['violations']} {report['violations_by_kind']}")
        for violation in report["violation_details"][:20]:
            print(f"  {json.dumps(violation, default=str)[:600]}")
        print(f"seconds: {report['seconds']}")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

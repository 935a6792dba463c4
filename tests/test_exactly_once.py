"""A refund is paid once, and recorded as the gateway has it, under faults: two workers at once, a
worker that dies mid-call, a timeout after the gateway acted, a key the gateway has forgotten, a
decline of a duplicate, a success that arrives after we gave up. Real PostgreSQL; gateways are the
sandbox (its own ledger) and the fake Stripe over a socket, through the official SDK."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEntry
from processors import sandbox
from processors.base import ProcessorUnavailable, RefundRequest, RefundResult
from processors.models import SandboxRefund
from processors.money import Money
from processors.registry import get_processor
from refundops import tasks
from refundops.models import GatewayAttempt, LedgerDiscrepancy, Payment, Refund, RefundState
from refundops.services import attempts, payouts
from refundops.services.refunds import sync_payment_amounts
from tests.conftest import make_payment, post, race
from tests.fakes.fixtures import stripe_account, stripe_payment
from tests.fakes.stripe_server import FakeStripe

S = RefundState
O = GatewayAttempt.Outcome


def approved_refund(payment: Payment, amount: int) -> Refund:
    refund = Refund.objects.create(payment=payment, amount_minor=amount, currency=payment.currency,
                                   reason="duplicate", status=S.APPROVED)
    sync_payment_amounts(payment)
    payment.save()
    return refund


def refund_posts(fake: FakeStripe) -> int:
    with fake.lock:
        return sum(1 for r in fake.received if r.method == "POST" and r.path == "/v1/refunds")


def pay_at_gateway_behind_our_back(refund: Refund) -> str:
    """The gateway call of a worker that then died: the money left, nothing of ours recorded it."""
    result = get_processor(refund.payment.processor).refund(RefundRequest(
        payment=payouts.payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
        idempotency_key=attempts.idempotency_key(refund), refund_id=refund.pk, verdict_id=""))
    return result.processor_refund_id


def attempt(refund: Refund, outcome: str, *, lease_seconds: float = -1) -> GatewayAttempt:
    return GatewayAttempt.objects.create(refund=refund, idempotency_key=attempts.idempotency_key(refund),
                                         outcome=outcome, worker="elsewhere:1",
                                         lease_until=timezone.now() + timedelta(seconds=lease_seconds))


# -- finding 1: two workers at once, and what a duplicate's decline may not do ------------------------
@pytest.mark.django_db(transaction=True)
def test_eight_workers_submitting_one_full_refund_at_once_pay_it_once_and_record_it_paid(policy, api):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    refund = approved_refund(payment, 5_000)

    def submit(i: int) -> str:
        try:
            return payouts.submit_refund(refund_id=refund.pk).status
        except attempts.RetryLater:
            return "retry later"  # another worker holds the lease: the task comes back later

    outcomes = race(8, submit)

    refund.refresh_from_db()
    assert SandboxRefund.objects.filter(charge__reference=payment.processor_reference).count() == 1
    assert refund.status in (S.SUBMITTED, S.SETTLED), outcomes
    assert GatewayAttempt.objects.filter(refund=refund).count() == 1
    payment.refresh_from_db()
    assert payment.refundable_minor == 0
    again = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 5_000, "reason": "duplicate"})
    assert again.status_code == 422 and again.json()["error"]["code"] == "PAYMENT_NOT_REFUNDABLE"


@pytest.mark.django_db
def test_no_call_goes_out_while_another_worker_holds_the_lease(gateways, stripe_fake):
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    attempt(refund, O.LIVE, lease_seconds=60)

    with pytest.raises(attempts.RetryLater) as later:
        payouts.submit_refund(refund_id=refund.pk)

    assert refund_posts(stripe_fake) == 0
    assert 50 < later.value.retry_after <= 60
    refund.refresh_from_db()
    assert refund.status == S.APPROVED


@pytest.mark.django_db
def test_a_decline_never_fails_a_refund_another_call_may_have_paid(gateways, stripe_fake):
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    mine = attempt(refund, O.LIVE, lease_seconds=60)
    attempt_elsewhere = GatewayAttempt.objects.create(refund=refund, idempotency_key="x", outcome=O.UNKNOWN,
                                                      lease_until=timezone.now())
    GatewayAttempt.objects.filter(pk=mine.pk).update(outcome=O.LIVE)

    with pytest.raises(attempts.RetryLater):
        payouts.record_gateway_decline(attempt=mine, code="amount_too_large", message="already refunded")

    refund.refresh_from_db()
    assert refund.status == S.APPROVED
    assert GatewayAttempt.objects.get(pk=mine.pk).outcome == O.DECLINED
    assert GatewayAttempt.objects.get(pk=attempt_elsewhere.pk).outcome == O.UNKNOWN
    assert AuditEntry.objects.filter(action="refund.decline_set_aside", subject_id=refund.pk).exists()


@pytest.mark.django_db
def test_a_workers_decline_never_fails_a_submitted_refund(gateways, stripe_fake):
    stripe_fake.next_refund_status = "pending"
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    payouts.submit_refund(refund_id=refund.pk)
    refund.refresh_from_db()
    assert refund.status == S.SUBMITTED

    payouts.record_gateway_failure(refund_id=refund.pk, code="amount_too_large", message="a duplicate's answer")

    refund.refresh_from_db()
    assert refund.status in (S.SUBMITTED, S.SETTLED) and refund.failure_code == ""


# -- a success is never dropped ---------------------------------------------------------------------
@pytest.mark.django_db
def test_a_success_on_a_refund_we_recorded_failed_reinstates_it(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = approved_refund(payment, 5_000)
    payouts.record_gateway_failure(refund_id=refund.pk, code="amount_too_large", message="a duplicate's answer")
    paid = pay_at_gateway_behind_our_back(refund)

    payouts.record_gateway_result(refund_id=refund.pk, result=get_processor("stripe").fetch_refund(paid))

    refund.refresh_from_db()
    assert (refund.status, refund.processor_refund_id) == (S.SETTLED, paid)
    payment.refresh_from_db()
    assert payment.refundable_minor == 0
    assert AuditEntry.objects.filter(action="refund.reinstated", subject_id=refund.pk).exists()


@pytest.mark.django_db
def test_a_success_the_ledger_can_no_longer_take_is_raised_to_a_person(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = approved_refund(payment, 5_000)
    payouts.record_gateway_failure(refund_id=refund.pk, code="amount_too_large", message="a duplicate's answer")
    approved_refund(payment, 5_000)  # the room went to a new refund meanwhile
    paid = RefundResult(processor_refund_id="re_late", status="succeeded", amount=Money(5_000, "USD"))

    payouts.record_gateway_result(refund_id=refund.pk, result=paid)

    refund.refresh_from_db()
    assert refund.status == S.FAILED
    gap = LedgerDiscrepancy.objects.get(payment=payment, status="open")
    assert (gap.kind, gap.gateway_reference, gap.refund_id) == ("paid_not_settled", "re_late", refund.pk)
    assert AuditEntry.objects.filter(action="ledger.discrepancy", subject_id=payment.pk).exists()


@pytest.mark.django_db
def test_a_second_gateway_refund_for_one_refund_is_raised_as_paid_twice(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = approved_refund(payment, 1_000)
    payouts.submit_refund(refund_id=refund.pk)
    twin = RefundResult(processor_refund_id="re_twin", status="succeeded", amount=Money(1_000, "USD"))

    payouts.record_gateway_result(refund_id=refund.pk, result=twin)

    gap = LedgerDiscrepancy.objects.get(payment=payment)
    assert (gap.kind, gap.gateway_reference) == ("paid_not_settled", "re_twin")


# -- findings 1 and 6: an answer that never came is looked up before anything else ---------------------
@pytest.mark.django_db
def test_a_worker_that_died_mid_call_is_looked_up_not_called_again(gateways, stripe_fake):
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    attempt(refund, O.LIVE, lease_seconds=-1)  # its lease ran out: the worker is gone
    paid = pay_at_gateway_behind_our_back(refund)
    stripe_fake.forget_idempotency_keys()  # a day later: Stripe no longer knows the key

    payouts.submit_refund(refund_id=refund.pk)

    assert refund_posts(stripe_fake) == 1  # only the dead worker's
    refund.refresh_from_db()
    assert refund.status in (S.SUBMITTED, S.SETTLED) and refund.processor_refund_id == paid
    assert list(refund.attempts.values_list("outcome", flat=True)) == [O.SUCCEEDED]


@pytest.mark.django_db
def test_an_unknown_answer_not_found_at_the_gateway_is_called_once_more(gateways, stripe_fake):
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    attempt(refund, O.UNKNOWN)

    payouts.submit_refund(refund_id=refund.pk)

    assert refund_posts(stripe_fake) == 1
    refund.refresh_from_db()
    assert refund.status in (S.SUBMITTED, S.SETTLED)
    assert list(refund.attempts.values_list("outcome", flat=True)) == [O.ABSENT, O.SUCCEEDED]


@pytest.mark.django_db
def test_a_timeout_after_the_gateway_acted_leaves_the_refund_approved_and_pays_it_once(settings, stripe_fake):
    settings.PROCESSORS = {"stripe": {"default": {**stripe_account(stripe_fake), "timeout": 0.5}}}
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    stripe_fake.set_mode("slow_after", slow_seconds=1.5)

    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund.pk)

    refund.refresh_from_db()
    assert refund.status == S.APPROVED
    assert list(refund.attempts.values_list("outcome", flat=True)) == [O.UNKNOWN]
    stripe_fake.set_mode("up")
    stripe_fake.forget_idempotency_keys()

    payouts.submit_refund(refund_id=refund.pk)

    refund.refresh_from_db()
    assert refund.status in (S.SUBMITTED, S.SETTLED)
    assert stripe_fake.refund_count == 1


@pytest.mark.django_db
def test_a_duplicate_told_the_key_is_in_use_neither_pays_nor_fails(settings, stripe_fake):
    """Stripe answers 409 to a second request while the first with its key is in flight."""
    settings.PROCESSORS = {"stripe": {"default": stripe_account(stripe_fake)}}
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    stripe_fake.set_mode("slow_after", slow_seconds=2)
    with stripe_fake.lock:
        stripe_fake._in_flight.add(attempts.idempotency_key(refund))

    with pytest.raises(ProcessorUnavailable) as in_use:
        payouts.submit_refund(refund_id=refund.pk)

    assert "in-progress" in in_use.value.message
    refund.refresh_from_db()
    assert refund.status == S.APPROVED and stripe_fake.refund_count == 0


# -- the sweeper, retries and their countdowns --------------------------------------------------------
@pytest.mark.django_db
def test_the_sweeper_leaves_a_refund_whose_call_is_live_alone(gateways, stripe_fake):
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    GatewayAttempt.objects.create(refund=refund, idempotency_key=attempts.idempotency_key(refund),
                                  lease_until=timezone.now() + timedelta(seconds=60))
    long_ago = timezone.now() - timedelta(hours=1)
    Refund.objects.filter(pk=refund.pk).update(updated_at=long_ago)
    GatewayAttempt.objects.filter(refund=refund).update(started_at=long_ago)

    assert tasks.resubmit_stalled_refunds(older_than_seconds=300) == 0
    assert refund_posts(stripe_fake) == 0


@pytest.mark.django_db
def test_the_sweeper_pays_an_approved_refund_nothing_works_on(gateways, stripe_fake):
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    Refund.objects.filter(pk=refund.pk).update(updated_at=timezone.now() - timedelta(hours=1))

    assert tasks.resubmit_stalled_refunds(older_than_seconds=300) == 1

    refund.refresh_from_db()
    assert refund.status in (S.SUBMITTED, S.SETTLED)
    assert refund_posts(stripe_fake) == 1


@pytest.mark.django_db
def test_retries_run_out_and_the_sweeper_finishes_the_job_once_the_gateway_is_back(settings):
    settings.REFUND_SUBMIT_MAX_RETRIES = 2
    sandbox.set_mode("down", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    refund = approved_refund(payment, 700)

    assert tasks.submit_refund.apply(kwargs={"refund_id": refund.pk}).get() == S.APPROVED

    assert list(refund.attempts.values_list("outcome", flat=True)) == [O.UNKNOWN]
    sandbox.set_mode("up")
    Refund.objects.filter(pk=refund.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    GatewayAttempt.objects.filter(refund=refund).update(started_at=timezone.now() - timedelta(hours=1),
                                                        finished_at=timezone.now() - timedelta(hours=1))
    assert tasks.resubmit_stalled_refunds(older_than_seconds=300) == 1
    refund.refresh_from_db()
    assert refund.status == S.SETTLED
    assert SandboxRefund.objects.count() == 1


def test_no_countdown_reaches_the_brokers_visibility_timeout(settings):
    settings.CELERY_VISIBILITY_TIMEOUT_SECONDS = 600
    assert tasks.backoff_seconds(30, retry_after=86_400) <= 480
    assert tasks.backoff_seconds(0, retry_after=None) <= 480


@pytest.mark.django_db
def test_a_poll_that_cannot_reach_the_gateway_or_is_refused_leaves_the_refund_submitted(gateways, stripe_fake):
    stripe_fake.next_refund_status = "pending"
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    payouts.submit_refund(refund_id=refund.pk)
    stripe_fake.set_mode("down")
    assert tasks.poll_refund(refund_id=refund.pk) == S.SUBMITTED
    stripe_fake.set_mode("up")
    Refund.objects.filter(pk=refund.pk).update(processor_refund_id="re_nobody_knows")
    assert tasks.poll_refund(refund_id=refund.pk) == S.SUBMITTED
    refund.refresh_from_db()
    assert refund.status == S.SUBMITTED


@pytest.mark.django_db
def test_the_gateways_news_of_a_refund_whose_answer_was_unknown_resolves_that_attempt(settings, stripe_fake):
    """Found by bench/chaos.py: a timeout after Stripe acted leaves the attempt unknown; Stripe's
    webhook then settles the refund. Nothing looks a finished refund's attempts up again, so the
    news itself must resolve it, or it stays 'answer unknown' forever."""
    from django.test import Client

    from tests.fakes.fixtures import STRIPE_WEBHOOK_SECRET, post_stripe_event, stripe_event

    settings.PROCESSORS = {"stripe": {"default": {**stripe_account(stripe_fake), "timeout": 0.5}}}
    refund = approved_refund(stripe_payment(stripe_fake), 1_000)
    stripe_fake.set_mode("slow_after", slow_seconds=1.5)
    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund.pk)
    stripe_fake.set_mode("up")
    [made] = stripe_fake.refunds.values()

    answer = post_stripe_event(Client(), stripe_event("charge.refund.updated", dict(made)),
                               secret=STRIPE_WEBHOOK_SECRET)

    assert answer.status_code == 200
    refund.refresh_from_db()
    assert refund.status == S.SETTLED and refund.processor_refund_id == made["id"]
    assert list(refund.attempts.values_list("outcome", "processor_refund_id")) == [(O.SUCCEEDED, made["id"])]


# -- review 8: a refund of someone else's that carries our refund id in its metadata -------------------
def refund_on_gateway_naming(refund: Refund, payment: Payment, amount: int) -> str:
    """A refund made on the gateway directly (dashboard, another integration) on ``payment`` for
    ``amount``, whose metadata names our ``refund`` (copied, or forged)."""
    made = get_processor("stripe").refund(RefundRequest(
        payment=payouts.payment_ref(payment), amount=Money(amount, payment.currency), reason="duplicate",
        idempotency_key=f"dashboard:{payment.pk}:{amount}", refund_id=refund.pk, verdict_id=""))
    return made.processor_refund_id


def deliver_refund_event(stripe_fake: FakeStripe, processor_refund_id: str):
    from django.test import Client

    from tests.fakes.fixtures import STRIPE_WEBHOOK_SECRET, post_stripe_event, stripe_event

    with stripe_fake.lock:
        body = dict(stripe_fake.refunds[processor_refund_id])
    return post_stripe_event(Client(), stripe_event("charge.refund.updated", body), secret=STRIPE_WEBHOOK_SECRET)


@pytest.mark.django_db
def test_a_refund_on_another_payment_naming_our_refund_is_not_taken_for_it(gateways, stripe_fake):
    ours = approved_refund(stripe_payment(stripe_fake, 5_000), 1_000)
    other = stripe_payment(stripe_fake, 5_000)
    made = refund_on_gateway_naming(ours, other, 5_000)

    assert deliver_refund_event(stripe_fake, made).status_code == 200

    ours.refresh_from_db()
    assert (ours.status, ours.processor_refund_id) == (S.APPROVED, "")  # still ours to pay
    other.refresh_from_db()
    assert other.refunds.get().processor_refund_id == made  # recorded where the money left
    assert other.refundable_minor == 0


@pytest.mark.django_db
def test_a_refund_of_another_amount_naming_our_refund_is_recorded_beside_it(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    ours = approved_refund(payment, 1_000)
    made = refund_on_gateway_naming(ours, payment, 3_000)

    assert deliver_refund_event(stripe_fake, made).status_code == 200

    ours.refresh_from_db()
    assert (ours.status, ours.processor_refund_id) == (S.APPROVED, "")
    payouts.submit_refund(refund_id=ours.pk)
    ours.refresh_from_db()
    assert ours.status in (S.SUBMITTED, S.SETTLED) and ours.processor_refund_id != made
    payment.refresh_from_db()
    assert payment.refundable_minor == 1_000  # 5,000 - 3,000 (theirs) - 1,000 (ours), as the gateway has it


@pytest.mark.django_db
def test_an_unknown_answer_is_not_resolved_by_a_refund_of_another_amount_naming_it(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    ours = approved_refund(payment, 1_000)
    attempt(ours, O.UNKNOWN)
    made = refund_on_gateway_naming(ours, payment, 3_000)

    payouts.submit_refund(refund_id=ours.pk)

    ours.refresh_from_db()
    assert ours.status in (S.SUBMITTED, S.SETTLED) and ours.processor_refund_id not in ("", made)
    assert stripe_fake.refund_count == 2


@pytest.mark.django_db(transaction=True)
def test_the_sandbox_answers_a_concurrent_duplicate_with_the_first_refund_never_a_decline():
    """The sandbox promises a repeated key the first refund. Two calls with one key at once (a
    worker whose lease ran out mid-call, and the one that took over) both looked the key up before
    either had written, and the second was declined amount_too_large: a decline that fails a refund
    the first call paid. The key is looked up again under the charge's lock."""
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    refund = approved_refund(payment, 5_000)
    request = RefundRequest(payment=payouts.payment_ref(payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=attempts.idempotency_key(refund), refund_id=refund.pk, verdict_id="")

    def call(i: int) -> str:
        try:
            return get_processor("sandbox").refund(request).processor_refund_id
        except Exception as exc:  # noqa: BLE001 - the answer under test
            return f"{type(exc).__name__}: {getattr(exc, 'code', exc)}"

    answers = race(8, call)

    made = SandboxRefund.objects.get(charge__reference=payment.processor_reference)
    assert answers == [made.reference] * 8


@pytest.mark.django_db(transaction=True)
def test_the_sandbox_pays_a_key_once_when_a_duplicate_waits_on_the_charge_and_finds_room_left():
    """The sandbox's one-statement refund (the charge raised where the key is unseen, and the refund
    inserted) sees the key as of its start. A duplicate that started while the first call's
    transaction held the charge finds room left once it gets the lock and raises the charge again:
    the key's unique index must refuse its refund and undo that raise with it, and the duplicate
    answers the first refund. The charge is raised once."""
    import threading
    import time

    from django.db import connection, transaction

    from processors.models import SandboxCharge

    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    refund = approved_refund(payment, 1_000)
    request = RefundRequest(payment=payouts.payment_ref(payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=attempts.idempotency_key(refund), refund_id=refund.pk, verdict_id="")
    first_holds_the_charge, answers = threading.Event(), {}

    def duplicate() -> None:
        first_holds_the_charge.wait(10)
        try:
            answers["duplicate"] = get_processor("sandbox").refund(request).processor_refund_id
        except Exception as exc:  # noqa: BLE001 - the answer under test
            answers["duplicate"] = f"{type(exc).__name__}: {getattr(exc, 'code', exc)}"
        finally:
            connection.close()

    second = threading.Thread(target=duplicate)
    second.start()
    with transaction.atomic():  # the first call's refund written, not committed until the duplicate waits
        answers["first"] = get_processor("sandbox").refund(request).processor_refund_id
        first_holds_the_charge.set()
        with connection.cursor() as cursor:  # until the duplicate's statement waits on the charge's lock
            for _ in range(200):
                cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'")
                if cursor.fetchone()[0]:
                    break
                time.sleep(0.02)
            else:
                pytest.fail("the duplicate never waited on the charge")
    second.join(10)

    made = SandboxRefund.objects.get(charge__reference=payment.processor_reference)
    assert answers == {"first": made.reference, "duplicate": made.reference}
    assert SandboxCharge.objects.get(reference=payment.processor_reference).refunded_minor == 1_000


@pytest.mark.django_db(transaction=True)
def test_a_webhook_and_a_second_worker_during_the_first_workers_call_pay_once_and_agree(gateways, stripe_fake):
    """The gateway acts, its event comes in, and another worker picks the refund up, all while the
    first worker still waits for its answer."""
    import time

    refund = approved_refund(stripe_payment(stripe_fake, 5_000), 5_000)
    stripe_fake.set_mode("slow_after", slow_seconds=1.5, requests=1, path="/v1/refunds")

    def work(i: int) -> str:
        if i == 0:
            return payouts.submit_refund(refund_id=refund.pk).status
        while not stripe_fake.refund_count:
            time.sleep(0.02)
        if i == 1:
            return str(deliver_refund_event(stripe_fake, next(iter(stripe_fake.refunds))).status_code)
        try:
            return payouts.submit_refund(refund_id=refund.pk).status
        except attempts.RetryLater:
            return "retry later"

    outcomes = race(3, work)

    refund.refresh_from_db()
    assert stripe_fake.refund_count == 1 and refund_posts(stripe_fake) == 1, outcomes
    assert outcomes[1] == "200"
    assert (refund.status, refund.processor_refund_id) == (S.SETTLED, next(iter(stripe_fake.refunds)))
    assert set(refund.attempts.values_list("outcome", flat=True)) == {O.SUCCEEDED}
    assert not LedgerDiscrepancy.objects.exists()
    payment = Payment.objects.get(pk=refund.payment_id)
    assert payment.refundable_minor == 0 and payment.amount_refunded_minor == 5_000


@pytest.mark.django_db(transaction=True)
def test_a_look_up_never_settles_a_call_that_started_after_the_gateway_was_read(gateways, stripe_fake):
    """A slow look-up reads the gateway's book; meanwhile another worker's call goes out and its
    answer is lost. The old book cannot say that call made nothing: it is looked up again, not
    marked absent and called once more (a forgotten key would then pay twice)."""
    import time

    refund = approved_refund(stripe_payment(stripe_fake, 5_000), 5_000)
    first = attempt(refund, O.UNKNOWN)
    GatewayAttempt.objects.filter(pk=first.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    stripe_fake.set_mode("slow_after", slow_seconds=1.5, requests=1, path="/v1/refunds")

    def work(i: int) -> str:
        if i == 0:
            return payouts.resolve_unknown_attempts(refund_id=refund.pk).status
        while not any(r.method == "GET" and r.path == "/v1/refunds" for r in list(stripe_fake.received)):
            time.sleep(0.02)
        # another worker: looked the first call up (nothing), called again, and lost the answer
        GatewayAttempt.objects.filter(pk=first.pk).update(outcome=O.ABSENT)
        attempt(refund, O.UNKNOWN)
        return pay_at_gateway_behind_our_back(refund)

    _, paid = race(2, work)

    assert refund.attempts.order_by("started_at").last().outcome != O.ABSENT
    stripe_fake.forget_idempotency_keys()
    payouts.submit_refund(refund_id=refund.pk)
    refund.refresh_from_db()
    assert (refund.status, refund.processor_refund_id) == (S.SETTLED, paid)
    assert stripe_fake.refund_count == 1


@pytest.mark.django_db
def test_the_answer_closes_its_attempt_and_resolves_the_refunds_other_open_calls_in_one_statement(policy):
    """A worker's answer closes its own attempt (even one a look-up had marked absent meanwhile) and,
    being news of the refund's current submission, resolves the submission's other unanswered calls;
    a declined call, and a call of an earlier submission (another key), stay as they were."""
    refund = approved_refund(make_payment(amount=5_000), 1_000)
    ours = attempt(refund, O.ABSENT)  # a look-up found nothing before our answer came: a success is news
    stale = attempt(refund, O.LIVE)  # another worker's, its lease run out
    unknown = attempt(refund, O.UNKNOWN)
    declined = attempt(refund, O.DECLINED)
    earlier = GatewayAttempt.objects.create(refund=refund, idempotency_key="refundops:earlier:0", outcome=O.UNKNOWN,
                                            lease_until=timezone.now())
    result = RefundResult(processor_refund_id="sbre_news", status="succeeded", amount=Money(1_000, "USD"))

    refund = payouts.record_gateway_result(refund_id=refund.pk, result=result, attempt=ours)

    assert refund.status == S.SETTLED and refund.processor_refund_id == "sbre_news"
    rows = {a.pk: a for a in GatewayAttempt.objects.filter(refund=refund)}
    assert (rows[ours.pk].outcome, rows[ours.pk].processor_refund_id, rows[ours.pk].error_message) == (
        O.SUCCEEDED, "sbre_news", "")
    for other in (stale, unknown):
        assert (rows[other.pk].outcome, rows[other.pk].processor_refund_id, rows[other.pk].error_message) == (
            O.SUCCEEDED, "sbre_news", attempts.NEWS)
        assert rows[other.pk].finished_at is not None
    assert rows[declined.pk].outcome == O.DECLINED and rows[declined.pk].processor_refund_id == ""
    assert rows[earlier.pk].outcome == O.UNKNOWN and rows[earlier.pk].processor_refund_id == ""

"""The circuit breaker over agent refund volume: trips, pauses, half-opens, closes. And the manual
kill switch. Time is passed in (``now``), so nothing here waits."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.core import mail

from audit.models import AuditEntry
from refundops import breaker
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.models import PlatformState, Refund
from refundops.services.refunds import request_refund
from tests.conftest import make_payment, make_staff, post

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=dt_timezone.utc)


@pytest.fixture
def tuned(settings):
    settings.BREAKER_WINDOW_MINUTES = 5
    settings.BREAKER_BASELINE_MINUTES = 60
    settings.BREAKER_FACTOR = 5
    settings.BREAKER_MIN_COUNT = 10
    settings.BREAKER_MIN_VALUE = 1_000  # 1,000.00 USD, 1,000 JPY
    settings.BREAKER_COOLDOWN_SECONDS = 600
    settings.BREAKER_HALF_OPEN_PROBES = 3
    settings.OPERATOR_EMAILS = ["ops@example.com"]
    return settings


def record(n: int, *, at: datetime, amount: int = 100, currency: str = "USD") -> None:
    for _ in range(n):
        breaker.record_refund(amount, currency, at)


@pytest.mark.django_db
def test_a_quiet_system_does_not_trip_on_its_first_refunds(tuned):
    record(10, at=T0)  # at the floor
    assert breaker.status(now=T0) == "closed"


@pytest.mark.django_db
def test_trips_on_count_above_the_floor_and_alerts_operators(tuned, caplog, django_capture_on_commit_callbacks):
    with caplog.at_level(logging.ERROR, logger="refundops.breaker"), \
            django_capture_on_commit_callbacks(execute=True):
        record(11, at=T0)
    assert breaker.is_open(now=T0) and breaker.status(now=T0) == "open"
    assert any("breaker opened" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    assert [m.to for m in mail.outbox] == [["ops@example.com"]]
    assert "Agent refunds are paused" in mail.outbox[0].body
    entry = AuditEntry.objects.get(action="breaker.opened")
    assert "11 agent refunds in 5 minutes" in entry.data["reason"]
    record(5, at=T0)  # more refunds while open (e.g. in flight) alert no one again
    assert AuditEntry.objects.filter(action="breaker.opened").count() == 1


@pytest.mark.django_db
def test_trips_on_value_in_one_currency(tuned):
    record(2, at=T0, amount=40_000)  # 800.00 USD
    record(1, at=T0, amount=900, currency="JPY")  # 900 JPY: its own currency, its own floor
    assert breaker.status(now=T0) == "closed"
    record(1, at=T0, amount=20_001)  # 1,000.01 USD
    assert breaker.status(now=T0) == "open"
    assert "1,000.01 USD" in AuditEntry.objects.get(action="breaker.opened").data["reason"]


@pytest.mark.django_db
def test_the_normal_rate_is_the_trailing_hour_times_the_factor(tuned):
    start = T0 - timedelta(minutes=65)
    for minute in range(60):  # a steady 4 a minute: 20 per 5 minutes, so the limit is 100
        record(4, at=start + timedelta(minutes=minute))
    now = T0 - timedelta(minutes=1)
    record(100, at=now)
    assert breaker.status(now=now) == "closed"
    record(1, at=now)
    assert breaker.status(now=now) == "open"


@pytest.mark.django_db
def test_open_pauses_agent_refunds_with_circuit_open_but_not_staff(api, policy, tuned, settings,
                                                                   django_capture_on_commit_callbacks):
    settings.BREAKER_MIN_COUNT = 2
    payments = [make_payment() for _ in range(4)]
    answers = []
    for p in payments:  # the service counts a refund once its transaction commits
        with django_capture_on_commit_callbacks(execute=True):
            answers.append(post(api, "/api/v1/refunds", {"transaction_id": p.pk, "amount": 100,
                                                         "reason": "duplicate"}))
    assert [a.status_code for a in answers] == [201, 201, 201, 503]  # the third trips it
    error = answers[3].json()["error"]
    assert error["code"] == "CIRCUIT_OPEN" and "breaker" in error["message"]
    assert Refund.objects.get(pk=error["refund_id"]).status == "denied"
    staff = make_staff("finance")
    answer = request_refund(caller=Caller.for_user(staff), idempotency_key=uuid.uuid4().hex,
                            data={"transaction_id": payments[3].pk, "amount": 100, "reason": "duplicate"})
    assert answer.status == 201


@pytest.mark.django_db
def test_half_opens_after_the_cooldown_and_closes_after_the_probes(tuned):
    record(11, at=T0)
    assert breaker.status(now=T0 + timedelta(seconds=599)) == "open"
    later = T0 + timedelta(seconds=600)
    assert breaker.status(now=later) == "half_open" and not breaker.is_open(now=later)
    record(2, at=later)
    assert breaker.status(now=later) == "half_open"
    record(1, at=later)  # the third probe
    assert breaker.status(now=later) == "closed"
    assert AuditEntry.objects.filter(action="breaker.closed").count() == 1


@pytest.mark.django_db
def test_half_open_opens_again_if_the_volume_is_still_abnormal(tuned, settings):
    settings.BREAKER_HALF_OPEN_PROBES = 50
    record(11, at=T0)
    later = T0 + timedelta(seconds=600)
    record(11, at=later)
    assert breaker.status(now=later) == "open"
    assert breaker.status(now=later + timedelta(seconds=599)) == "open"
    reopened = AuditEntry.objects.filter(action="breaker.opened").order_by("id").last()
    assert reopened.data["reopened"] is True


@pytest.mark.django_db
def test_minutes_past_the_baseline_are_forgotten_and_the_series_expire(tuned):
    """One script counts, sums and cleans (refundops/breaker.py): a minute that has left the
    baseline (65 minutes with the window) loses its field, and each series expires an hour and six
    minutes after its last count."""
    from processors.redis_client import redis_client

    client = redis_client()
    minute = int(T0.timestamp() // 60)
    record(1, at=T0)
    later = T0 + timedelta(minutes=65)  # T0's minute is now the first before the baseline
    record(1, at=later - timedelta(minutes=1))
    assert int(client.hget(breaker._series_key("n"), minute)) == 1
    record(1, at=later)
    assert client.hget(breaker._series_key("n"), minute) is None
    assert client.hget(breaker._series_key("v:USD"), minute) is None
    assert 0 < client.ttl(breaker._series_key("n")) <= 66 * 60
    assert breaker.status(now=later) == "closed"


@pytest.mark.django_db
def test_sums_of_large_values_stay_exact(tuned):
    tuned.BREAKER_MIN_VALUE = 1_000_000_000_000  # a trillion USD: 10^14 cents
    record(2, at=T0, amount=40_000_000_000_001)
    assert breaker.status(now=T0) == "closed"
    record(1, at=T0, amount=40_000_000_000_001)
    assert breaker.status(now=T0) == "open"
    assert "1,200,000,000,000.03 USD" in AuditEntry.objects.get(action="breaker.opened").data["reason"]


@pytest.mark.django_db
def test_a_batch_of_counts_goes_in_one_round_trip_and_trips_as_one_by_one(tuned, monkeypatch):
    """The outbox's sender counts its batch's refunds together (breaker.record_refunds): one
    pipeline of the script, loaded again if Redis has lost it; then each reply judged in turn, so
    the eleventh trips the breaker and the twelfth, which saw it closed, alerts no one again."""
    import redis as redis_py

    from processors.redis_client import redis_client

    fresh = f"{breaker._RECORD_LUA}\n-- {uuid.uuid4().hex}"  # a script this Redis has never seen: NOSCRIPT
    monkeypatch.setattr(breaker, "_record_script", lambda client: client.register_script(fresh))
    pipelines = []
    execute = redis_py.client.Pipeline.execute
    monkeypatch.setattr(redis_py.client.Pipeline, "execute", lambda self, *a, **kw: pipelines.append(
        len(self.command_stack)) or execute(self, *a, **kw))
    breaker.record_refunds([(100, "USD", T0)] * 12, request_ids=[f"req-{i}" for i in range(12)])
    assert pipelines == [12, 12]  # refused once (NOSCRIPT, none ran), loaded, sent again
    assert sum(int(n) for n in redis_client().hvals(breaker._series_key("n"))) == 12
    assert breaker.status(now=T0) == "open"
    (entry,) = AuditEntry.objects.filter(action="breaker.opened")
    assert "11 agent refunds in 5 minutes" in entry.data["reason"]


def test_without_redis_the_breaker_fails_closed(settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    with pytest.raises(ApiError) as refused:
        breaker.is_open(now=T0)
    assert refused.value.code == "SERVICE_UNAVAILABLE"
    with pytest.raises(ApiError):
        breaker.record_refund(100, "USD", T0)
    with pytest.raises(ApiError):  # a batch (the outbox's sender's): none counted, every row the relay's
        breaker.record_refunds([(100, "USD", T0)] * 2)


@pytest.mark.django_db
def test_kill_switch_pauses_agent_refunds_at_once_but_not_staff(api, policy):
    PlatformState.objects.update_or_create(pk=1, defaults={"refunds_paused": True})
    response = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100,
                                             "reason": "duplicate"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "CIRCUIT_OPEN"
    assert "kill switch" in response.json()["error"]["message"]
    staff = make_staff("finance")
    answer = request_refund(caller=Caller.for_user(staff), idempotency_key=uuid.uuid4().hex,
                            data={"transaction_id": make_payment().pk, "amount": 100, "reason": "duplicate"})
    assert answer.status == 201


@pytest.mark.django_db
def test_kill_switch_answers_after_the_payment_checks(api, policy):
    PlatformState.objects.update_or_create(pk=1, defaults={"refunds_paused": True})
    response = post(api, "/api/v1/refunds", {"transaction_id": make_payment(amount=100).pk, "amount": 101,
                                             "reason": "duplicate"})
    assert response.json()["error"]["code"] == "AMOUNT_EXCEEDS_REFUNDABLE"


@pytest.mark.django_db
def test_a_breaker_that_opens_while_the_refund_waits_for_its_payment_still_refuses_it(api, policy, tuned,
                                                                                       monkeypatch):
    """The breaker trips (count_agent_refund of refunds committed just before) while this request
    is already admitted and waits for its payment's row lock: the decision, taken after the lock,
    must see it open, as it did when the state was read after the lock (e1e7f66)."""
    from refundops.services import refunds

    locked = refunds._payment_to_decide_on

    def lock_then_trip(*args, **kwargs):
        payment = locked(*args, **kwargs)  # the wait for the row lock ends here
        record(11, at=datetime.now(dt_timezone.utc))  # meanwhile the breaker opened (a floor of 10)
        return payment

    monkeypatch.setattr(refunds, "_payment_to_decide_on", lock_then_trip)
    answer = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100, "reason": "duplicate"})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "CIRCUIT_OPEN", answer.json()


@pytest.mark.django_db
def test_a_batch_whose_first_count_opens_a_half_open_breaker_again_does_not_close_it_with_the_rest(tuned):
    """The sender's batch: every script of it ran (and read the state) before the first reply is
    judged. A half-open breaker that the first count opens again stays open: the counts after it,
    normal ones (another currency), are not probes of the half-open state their replies saw; one by
    one, as a worker counts, each sees it open."""
    record(11, at=T0)
    later = T0 + timedelta(seconds=600)
    assert breaker.status(now=later) == "half_open"
    breaker.record_refunds([(200_000, "USD", later)] + [(100, "EUR", later)] * 3)  # 2,000.00 USD: over
    assert breaker.status(now=later) == "open"
    assert not AuditEntry.objects.filter(action="breaker.closed").exists()
    assert AuditEntry.objects.filter(action="breaker.opened").order_by("id").last().data["reopened"] is True


@pytest.mark.django_db
def test_a_baseline_of_a_week_still_counts_and_trips(tuned):
    """The script reads the baseline's minutes in one HMGET: a week's baseline (10,080 minutes) is
    more fields than Lua unpacks at once (8,000), so every count failed ("too many results to
    unpack"), as Redis away, and the breaker never tripped. It counts, and trips, as with an hour."""
    from processors.redis_client import redis_client

    tuned.BREAKER_BASELINE_MINUTES = 7 * 24 * 60
    three_days_ago = int(T0.timestamp() // 60) - 3 * 24 * 60  # in the baseline, past its first 1,000 minutes
    redis_client().hincrby(breaker._series_key("v:USD"), three_days_ago, 10**12)
    record(1, at=T0, amount=200_000)  # 2,000.00 USD: over the floor, not over 5x the week's rate
    assert breaker.status(now=T0) == "closed"
    record(9, at=T0)
    assert breaker.status(now=T0) == "closed"
    record(1, at=T0)
    assert breaker.status(now=T0) == "open"
    (entry,) = AuditEntry.objects.filter(action="breaker.opened")
    assert "11 agent refunds in 5 minutes" in entry.data["reason"]


@pytest.mark.django_db
def test_probes_judged_on_a_half_open_state_another_process_has_opened_again_do_not_close_it(tuned):
    """Two senders (two web processes) count at once: one's batch read the breaker half-open, then
    the other's count opened it again, then the first judges its replies. Counted as probes of the
    half-open state they saw, three normal counts closed the breaker a moment after it re-opened
    (agent refunds through again at once); a probe counts only on the opening it was read under."""
    from processors.redis_client import redis_client

    record(11, at=T0)
    later = T0 + timedelta(seconds=600)
    client = redis_client()
    window, baseline = 5, 60
    first = int(later.timestamp() // 60) - window - baseline + 1
    keys = [breaker._series_key("n"), breaker._series_key("v:EUR"), breaker._state_key()]
    stale = breaker._run_scripts(client, [(keys, [int(later.timestamp() // 60), 100, first, baseline,
                                                  (window + baseline + 1) * 60])] * 3)  # read: half-open
    breaker.record_refund(200_000, "USD", later)  # the other process: 2,000.00 USD opens it again
    assert breaker.status(now=later) == "open"
    for reply in stale:
        breaker._judge(client, reply, currency="EUR", now=later, window=window, baseline=baseline)
    assert breaker.status(now=later) == "open"
    assert not AuditEntry.objects.filter(action="breaker.closed").exists()


@pytest.mark.django_db
def test_a_probe_counted_again_after_its_mark_failed_is_one_probe(api, policy, tuned, monkeypatch,
                                                                    django_capture_on_commit_callbacks):
    """A count is delivered at least once: counted, then its row's mark failed (or the process died,
    or a reply was lost and the worker retried), the relay hands it to a worker, which counts it
    again. Counted twice, the volume errs toward tripping; but a probe counted twice closed the
    half-open breaker after fewer approved refunds than BREAKER_HALF_OPEN_PROBES (here two refunds,
    each counted twice, closed it where three are needed). A refund is one probe however often its
    count is delivered."""
    from django.utils import timezone

    from processors.redis_client import redis_client
    from refundops import outbox
    from refundops.models import OutboxMessage

    redis_client().hset(breaker._state_key(), mapping={"opened_at": datetime.now(dt_timezone.utc).timestamp() - 601,
                                                       "successes": 0, "reason": "a test"})
    assert breaker.status(now=datetime.now(dt_timezone.utc)) == "half_open"
    record_sent = outbox._record

    def mark_fails(sent, failed):
        raise RuntimeError("the connection dropped before the mark")

    monkeypatch.setattr(outbox, "_record", mark_fails)
    for _ in range(2):
        with django_capture_on_commit_callbacks(execute=True):
            answer = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100,
                                                   "reason": "duplicate"})
        assert answer.status_code == 201, answer.json()
    assert breaker.status(now=datetime.now(dt_timezone.utc)) == "half_open"  # two probes of three
    monkeypatch.setattr(outbox, "_record", record_sent)
    OutboxMessage.objects.filter(sent_at__isnull=True).update(next_try_at=timezone.now())  # the claim ran out
    assert outbox.relay_unsent(older_than_seconds=0) == 4  # each refund's count (and submission) again
    assert breaker.status(now=datetime.now(dt_timezone.utc)) == "half_open"
    assert not AuditEntry.objects.filter(action="breaker.closed").exists()


@pytest.mark.django_db
def test_a_probe_the_sender_counted_and_a_worker_counts_again_is_one_probe(tuned):
    """The same, the first count run by the outbox's sender (count_in_sender), the second by a
    worker (count_agent_refund): each refund is one probe."""
    from refundops import tasks

    record(11, at=T0)
    later = T0 + timedelta(seconds=600)
    rows = [({"amount_minor": 100, "currency": "USD", "at": later.isoformat(), "refund_id": f"rf_{n}"}, None)
            for n in range(2)]
    tasks.count_in_sender(rows)
    for kwargs, _ in rows:
        tasks.count_agent_refund.apply(kwargs=kwargs).get()
    assert breaker.status(now=later) == "half_open"
    tasks.count_in_sender([({**rows[0][0], "refund_id": "rf_third"}, None)])
    assert breaker.status(now=later) == "closed"

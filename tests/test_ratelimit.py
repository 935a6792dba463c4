"""Rate limits per agent, per session and global: 429 RATE_LIMITED with Retry-After, in the
contract's order (key → capability → rate limits → body), failing closed without Redis."""

from __future__ import annotations

import threading

import pytest

from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.models import Agent
from processors.redis_client import redis_client, redis_key
from refundops.ratelimit import check_rate_limits
from tests.conftest import make_agent_key, make_payment, post

LIMITS = ("RATE_LIMIT_AGENT_PER_MINUTE", "RATE_LIMIT_SESSION_PER_MINUTE", "RATE_LIMIT_GLOBAL_PER_MINUTE")


@pytest.fixture
def limit(settings):
    def set_limits(agent: int = 0, session: int = 0, global_: int = 0) -> None:
        for name, value in zip(LIMITS, (agent, session, global_)):
            setattr(settings, name, value)
    return set_limits


def client_with(raw: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def assert_rate_limited(response, scope: str) -> None:
    assert response.status_code == 429, response.json()
    error = response.json()["error"]
    assert error["code"] == "RATE_LIMITED" and error["scope"] == scope
    assert 1 <= int(response["Retry-After"]) <= 60 and error["retry_after"] == int(response["Retry-After"])


def agent_caller(name: str) -> Caller:
    return Caller(agent=Agent(id=f"ag_{name}", name=name))


@pytest.mark.django_db
def test_agent_limit_answers_429_with_retry_after_and_spares_other_agents(api, policy, limit):
    limit(agent=3)
    payment = make_payment()
    for _ in range(3):
        assert api.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    assert_rate_limited(api.get(f"/api/v1/payments/{payment.pk}"), "agent")
    assert_rate_limited(post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate"}),
                        "agent")
    other = client_with(make_agent_key()[1])
    assert other.get(f"/api/v1/payments/{payment.pk}").status_code == 200


@pytest.mark.django_db
def test_session_limit_counts_each_agent_session_apart(api, policy, limit):
    limit(session=2)
    payment = make_payment()

    def check(session: str):
        return post(api, "/api/v1/refunds/check", {"transaction_id": payment.pk, "amount": 100,
                                                    "reason": "duplicate", "agent": {"session_id": session}})
    assert check("s1").status_code == check("s1").status_code == 200
    assert_rate_limited(check("s1"), "session")
    assert check("s2").status_code == 200


@pytest.mark.django_db
def test_global_limit_counts_every_agent(api, policy, limit):
    limit(global_=3)
    payment = make_payment()
    others = [client_with(make_agent_key()[1]) for _ in range(2)]
    for client in (api, *others):
        assert client.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    assert_rate_limited(api.get(f"/api/v1/payments/{payment.pk}"), "global")


@pytest.mark.django_db
def test_rate_limits_come_after_key_and_capability_and_before_the_body(api, policy, limit):
    limit(agent=1)
    payment = make_payment()
    assert api.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    assert_rate_limited(post(api, "/api/v1/refunds", {"amount": "not even valid"}), "agent")
    assert client_with("rk_unknown").get(f"/api/v1/payments/{payment.pk}").status_code == 401
    reader = client_with(make_agent_key("payments.read")[1])
    assert reader.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    refused = post(reader, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate"})
    assert refused.json()["error"]["code"] == "CAPABILITY_NOT_GRANTED"


def test_the_window_slides_and_refused_requests_use_no_budget(limit):
    limit(agent=3)
    caller = agent_caller("slider")
    for t in (0.0, 10.0, 20.0):
        check_rate_limits(caller=caller, now=1_000_000 + t)
    for t in (30.0, 59.0):
        with pytest.raises(ApiError) as refused:
            check_rate_limits(caller=caller, now=1_000_000 + t)
        assert refused.value.code == "RATE_LIMITED"
    assert refused.value.headers == {"Retry-After": "1"}  # the first request leaves the window at 60 s
    check_rate_limits(caller=caller, now=1_000_060.5)  # refused requests took no place in the window
    with pytest.raises(ApiError):
        check_rate_limits(caller=caller, now=1_000_061)
    check_rate_limits(caller=caller, now=1_000_070.5)


def test_racing_requests_admit_exactly_the_limit(limit):
    """One MULTI per request: 50 at once against a limit of 10 let exactly 10 through."""
    limit(agent=10)
    caller = agent_caller("racer")
    barrier = threading.Barrier(50)
    admitted: list[bool] = []

    def run() -> None:
        barrier.wait()
        try:
            check_rate_limits(caller=caller)
            admitted.append(True)
        except ApiError:
            admitted.append(False)

    threads = [threading.Thread(target=run) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert admitted.count(True) == 10 and len(admitted) == 50


def test_staff_callers_are_not_rate_limited(limit):
    limit(agent=1, global_=1)
    for _ in range(3):
        check_rate_limits(caller=Caller(user=object()))


@pytest.mark.django_db
def test_without_redis_money_moving_calls_fail_closed_and_lookups_work(api, policy, settings, limit):
    limit(agent=100)
    payment = make_payment()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 100, "reason": "duplicate"})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "SERVICE_UNAVAILABLE" and "Redis" in error["message"]
    assert response["Retry-After"]
    assert api.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    with pytest.raises(ApiError) as refused:
        check_rate_limits(caller=agent_caller("mcp"), session_id="s")
    assert refused.value.code == "SERVICE_UNAVAILABLE"


@pytest.mark.django_db
def test_embedded_mode_counts_in_an_in_process_fakeredis(api, policy, settings, limit):
    limit(agent=2)
    settings.REDIS_URL = ""
    payment = make_payment()
    for _ in range(2):
        assert api.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    assert_rate_limited(api.get(f"/api/v1/payments/{payment.pk}"), "agent")


def test_a_refused_request_takes_no_place_in_any_window_even_for_an_instant(limit):
    """40 requests of one agent race past its limit of 5 while another agent sends 5, under a global
    limit of 10: both agents' 5 fit, so all 10 are admitted. A refused request counted in the
    global window until it is taken out again would refuse some of the other agent's."""
    limit(agent=5, global_=10)
    callers = [agent_caller("hammer")] * 40 + [agent_caller("quiet")] * 5
    barrier = threading.Barrier(len(callers))
    admitted: list[str] = []
    refused: list[tuple[str, str]] = []

    def run(caller: Caller) -> None:
        barrier.wait()
        try:
            check_rate_limits(caller=caller)
            admitted.append(caller.agent.name)
        except ApiError as exc:
            refused.append((caller.agent.name, exc.extra["scope"]))

    threads = [threading.Thread(target=run, args=(caller,)) for caller in callers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(admitted) == ["hammer"] * 5 + ["quiet"] * 5
    assert refused == [("hammer", "agent")] * 35


def test_the_windows_hold_only_admitted_requests_and_expire_after_the_window(limit, settings):
    settings.RATE_LIMIT_WINDOW_SECONDS = 30
    limit(agent=2, session=5, global_=5)
    caller = agent_caller("keys")
    for t in (0.0, 1.0):
        check_rate_limits(caller=caller, session_id="s1", now=2_000_000 + t)
    with pytest.raises(ApiError):
        check_rate_limits(caller=caller, session_id="s1", now=2_000_002)
    client = redis_client()
    keys = sorted(k.decode() for k in client.scan_iter(match=redis_key("rl:*")))
    assert [k.split(":")[-2 if ":session:" in k else -1] for k in keys] == ["ag_keys", "global", "ag_keys"]
    for key in keys:  # the refused request is in no scope; every key outlives its newest entry by the window
        assert client.zrange(key, 0, -1, withscores=True)[1][1] == 2_000_001.0 and client.zcard(key) == 2
        assert 0 < client.ttl(key) <= 31


def test_the_limits_count_on_after_redis_forgets_the_script(limit):
    """A restarted or flushed Redis answers NOSCRIPT: the script is loaded again, nothing is refused."""
    limit(agent=2)
    caller = agent_caller("noscript")
    check_rate_limits(caller=caller)
    redis_client().script_flush()
    check_rate_limits(caller=caller)
    with pytest.raises(ApiError) as refused:
        check_rate_limits(caller=caller)
    assert refused.value.code == "RATE_LIMITED"

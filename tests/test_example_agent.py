"""examples/agent/: the example MCP agent, run as a user runs it, against a live server on a free
port. It looks up the payment, checks eligibility, asks for the refund and reports the verdict.
(Issue 13, finding 7.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from refundops.models import Capability, Refund
from tests.conftest import make_agent_key, make_payment

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.django_db(transaction=True)


def run_agent(url: str, key: str, payment: str, amount: int) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run([sys.executable, "examples/agent/agent.py", "--url", url, "--key", key,
                           "--payment", payment, "--amount", str(amount), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done, json.loads(done.stdout[done.stdout.index("\n{") + 1:])


def test_the_example_agent_refunds_and_reports_the_verdict(served, policy):  # noqa: F811
    raw = make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)[1]
    payment = make_payment(amount=5_000)
    done, outcome = run_agent(served, raw, payment.pk, 1_000)
    tools = [turn["name"] for turn in outcome["turns"] if turn["role"] == "tool"]
    assert tools == ["lookup_payment", "check_refund_eligibility", "create_refund"]
    refund = Refund.objects.get(payment=payment)
    assert refund.amount_minor == 1_000 and refund.agent_session_id.startswith("example-")
    assert outcome["reply"].startswith("I've issued a refund of 10.00 USD") and refund.pk in outcome["reply"]
    assert "customer: Hi, my order arrived broken" in done.stdout  # the conversation, as it happens


def test_the_example_agent_reports_a_hold_and_a_refusal_in_plain_words(served, policy):  # noqa: F811
    raw = make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)[1]
    big = make_payment(amount=900_000)
    _, held = run_agent(served, raw, big.pk, 800_000)
    assert "needs a quick review" in held["reply"]
    _, missing = run_agent(served, raw, "txn_" + "0" * 24, 1_000)
    assert "could not find that payment" in missing["reply"]
    old = make_payment(amount=5_000, captured_days_ago=400)
    _, refused = run_agent(served, raw, old.pk, 1_000)
    assert "REFUND_WINDOW_EXPIRED" in refused["reply"] and not Refund.objects.filter(payment=old).exists()


def test_a_wrong_key_is_one_plain_line_not_a_traceback(served, policy):  # noqa: F811
    """The server answers 401 UNAUTHENTICATED; the agent says so in one line. (Issue 29, finding 4.)"""
    payment = make_payment(amount=5_000)
    done = subprocess.run([sys.executable, "examples/agent/agent.py", "--url", served, "--key", "rk_wrong",
                           "--payment", payment.pk], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "UNAUTHENTICATED" in lines[0] and "--key" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr


def test_the_reply_says_each_thing_once(served, policy):  # noqa: F811
    """The server's suggested message already says the amount and where it goes: the reply does
    not say it again in other words. (Issue 29, finding 4.)"""
    raw = make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)[1]
    payment = make_payment(amount=5_000)
    _, done = run_agent(served, raw, payment.pk, 1_000)
    refund = Refund.objects.get(payment=payment)
    assert done["reply"].count("10.00 USD") == 1 and done["reply"].count("on its way") == 1, done["reply"]
    assert refund.pk in done["reply"]
    big = make_payment(amount=900_000)
    _, held = run_agent(served, raw, big.pk, 800_000)
    assert held["reply"].count("8,000.00 USD") + held["reply"].count("8000.00 USD") == 1, held["reply"]
    assert Refund.objects.get(payment=big).pk in held["reply"]

"""The policy a decision reads in one statement is the policy the ORM's three reads return."""

from __future__ import annotations

import pytest

from refundops.models import PolicyDraft
from refundops.selectors import active_limits, active_rules, policy_in_force, shadow_drafts
from tests.conftest import make_limits, make_rules

pytestmark = pytest.mark.django_db


def same(mine, theirs) -> None:
    assert type(mine) is type(theirs)
    for field in type(mine)._meta.concrete_fields:
        a, b = getattr(mine, field.attname), getattr(theirs, field.attname)
        assert (a, type(a)) == (b, type(b)), field.name
    assert (mine._state.adding, mine._state.db) == (False, theirs._state.db)


def test_one_statement_reads_the_latest_limits_rules_and_the_drafts_in_shadow(django_assert_num_queries):
    make_limits(reason_thresholds={"fraudulent": 2_000})
    make_limits(note="the latest", allowed_reasons=["duplicate"])
    make_limits("EUR", note="another currency's")
    make_rules()
    latest = make_rules(hold_flagged=False, velocity_window_hours=12)
    PolicyDraft.objects.create(kind="limits", currency="USD", values={"customer_daily_count": 1}, shadow=True)
    PolicyDraft.objects.create(kind="rules", values={"hold_flagged": True}, shadow=True, status="proposed")
    PolicyDraft.objects.create(kind="limits", currency="EUR", values={"customer_daily_count": 2}, shadow=True)
    PolicyDraft.objects.create(kind="limits", currency="USD", values={"customer_daily_count": 3})
    PolicyDraft.objects.create(kind="rules", values={}, shadow=False, status="dropped")

    with django_assert_num_queries(1):
        limits, rules, drafts = policy_in_force("USD")

    same(limits, active_limits("USD"))
    assert (limits.note, limits.reason_thresholds, limits.allowed_reasons) == ("the latest", {}, ["duplicate"])
    same(rules, active_rules())
    assert (rules.pk, rules.hold_flagged, rules.velocity_window_hours) == (latest.pk, False, 12)
    theirs = shadow_drafts("USD")
    assert [d.pk for d in drafts] == [d.pk for d in theirs] and len(drafts) == 2
    for mine, expected in zip(drafts, theirs):
        same(mine, expected)
    assert policy_in_force("USD", shadows=False)[2] == []


def test_a_currency_without_limits_reads_none():
    limits, rules, drafts = policy_in_force("GBP")
    assert (limits, drafts) == (None, [])
    assert rules == active_rules()

"""The reads every refund request makes, written by hand for speed, return what the ORM's queries
they replace return: the same instances, field by field, with the same related rows cached."""

from __future__ import annotations

import pytest

from django.db import transaction
from django.db.models import Exists

from refundops.access import _key_named, authenticate_key
from refundops.errors import ApiError
from refundops.models import AgentKey, LedgerDiscrepancy, Payment, PlatformState, PolicyDraft
from refundops.selectors import active_limits, active_rules, policy_in_force, shadow_drafts
from refundops.services.reconciliation import open_discrepancy_on
from refundops.services.refunds import _payment_to_decide_on
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules

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


def test_the_payment_read_under_lock_is_the_orms(django_assert_num_queries):
    customer = make_customer()
    payment = make_payment(customer=customer, amount=7_000)
    Payment.objects.filter(pk=payment.pk).update(fraud_flags=["velocity"], order_reference="ord-1")
    orm = (Payment.objects.select_related("customer").annotate(ledger_mismatch=open_discrepancy_on())
           .filter(pk=payment.pk).first())
    with transaction.atomic(), django_assert_num_queries(1) as queries:
        mine = _payment_to_decide_on(payment.pk, lock=True, merchant_id=payment.merchant_id)
    assert "FOR UPDATE OF p" in queries[0]["sql"]
    same(mine, orm)
    same(mine.customer, orm.customer)
    assert (mine.ledger_mismatch, mine.fraud_flags) == (False, ["velocity"])
    LedgerDiscrepancy.objects.create(payment=payment, kind=LedgerDiscrepancy.Kind.AMOUNT_MISMATCH,
                                     gateway="sandbox", ours={"refunded": 1}, theirs={"refunded": 2})
    assert _payment_to_decide_on(payment.pk, lock=False, merchant_id=None).ledger_mismatch is True
    assert _payment_to_decide_on(payment.pk, lock=False, merchant_id="mer_other") is None
    assert _payment_to_decide_on("txn_none", lock=False, merchant_id=None) is None


def test_the_key_read_is_the_orms(django_assert_num_queries):
    key, raw = make_agent_key()
    all_disabled = Exists(PlatformState.objects.filter(pk=1, agents_disabled=True))
    orm = (AgentKey.objects.select_related("agent__merchant").annotate(all_agents_disabled=all_disabled)
           .get(pk=key.pk))
    with django_assert_num_queries(1):
        mine = _key_named(key.prefix)
        same(mine, orm)
        same(mine.agent, orm.agent)
        same(mine.agent.merchant, orm.agent.merchant)
    assert mine.all_agents_disabled is False and _key_named("rk_nothere") is None
    assert authenticate_key(raw).pk == key.pk
    PlatformState.objects.update_or_create(pk=1, defaults={"agents_disabled": True})
    assert _key_named(key.prefix).all_agents_disabled is True
    with pytest.raises(ApiError, match="switched off"):
        authenticate_key(raw)


def test_a_refunds_merchant_endpoints_are_the_orms_active_endpoints_of_its_merchant():
    from django.db.models import Subquery

    from refundops.models import Merchant, MerchantEndpoint, Refund
    from refundops.outbound import active_endpoints

    acme = Merchant.objects.create(name="Acme")
    ours = MerchantEndpoint.objects.create(url="https://default.example/hook", event_types=["refund.approved"])
    MerchantEndpoint.objects.create(url="https://default.example/off", active=False)
    MerchantEndpoint.objects.create(url="https://acme.example/hook", merchant=acme)
    refund = Refund(payment=make_payment(), amount_minor=100, currency="USD", reason="duplicate")
    merchant = Payment.objects.filter(pk=refund.payment_id).values("merchant_id")[:1]
    orm = list(MerchantEndpoint.objects.filter(active=True, merchant_id=Subquery(merchant)))
    mine = active_endpoints(refund)
    assert [e.pk for e in mine] == [e.pk for e in orm] == [ours.pk]
    same(mine[0], orm[0])

"""refundops.rows: values prepared for an INSERT are the ORM's, value for value and type for type."""

from __future__ import annotations

import warnings
from datetime import date, datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import connection
from django.utils import timezone

from audit.models import AuditEntry, Verdict
from refundops.models import Refund
from refundops.rows import Prepared
from refundops.services.refunds import _historical_refund

pytestmark = pytest.mark.django_db


def orm_values(fields, obj):
    return [field.get_db_prep_save(field.pre_save(obj, True), connection) for field in fields]


def same(ours, theirs):
    """Equal, and of the same type (psycopg binds an Int8 and an int, a str and an enum alike, but
    a value left as the ORM leaves it must stay that)."""
    assert len(ours) == len(theirs)
    for mine, orm in zip(ours, theirs, strict=True):
        if hasattr(orm, "obj"):  # psycopg's Jsonb: its object
            assert type(mine) is type(orm) and mine.obj == orm.obj
        else:
            assert (type(mine), mine) == (type(orm), orm)


@pytest.fixture
def frozen_now(monkeypatch):
    """auto_now and auto_now_add read the same instant for both preparations."""
    now = datetime(2026, 12, 1, 8, 30, tzinfo=dt_timezone.utc)
    monkeypatch.setattr(timezone, "now", lambda: now)
    return now


def rows(now):
    aware = now - timedelta(hours=1)
    naive = datetime(2026, 11, 30, 12, 0)  # the ORM makes it aware (and warns)
    verdict = Verdict(id="vd_1", created_at=aware, operation="refund.create", dry_run=False, deduplicated=True,
                      outcome="approved", code="", message="café", amount_minor=True,  # a bool into an integer
                      currency="USD", request={"a": [1, 2]}, checks=[], totals={"x": 1}, hold_reasons=None,
                      policy_input={}, shadow={}, gateway_response=None, refund_id="", payment_id="txn_1")
    refund = Refund(id="rf_1", payment_id="txn_1", amount_minor=500, currency="USD", reason="duplicate",
                    agent_id=None, agent_key_id=7, requested_by_id=None, verdict_id="vd_1", hold_reasons=[],
                    estimated_arrival=date(2026, 12, 4), counted_at=naive, submitted_at=aware,
                    settled_at=now.date())  # a date into a datetime field
    refund.approve_automatically()  # the status an enum, not a plain str, as in a request
    entry = AuditEntry(uid=None, created_at=aware, actor="agent:x", action="refund.approved", subject_type="refund",
                       subject_id="rf_1", data={"k": "v"}, records=[], mac="m", prev_hash="", hash="", seq=None)
    return [verdict, refund, entry]


def test_prepared_values_are_the_orms(frozen_now):
    for obj in rows(frozen_now):
        fields = [f for f in type(obj)._meta.concrete_fields if not (f.primary_key and f.db_returning)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            theirs = orm_values(fields, obj)
            ours = Prepared(fields)(obj)
        same(ours, theirs)


def test_history_fields_prepare_a_refunds_values_as_the_orm(frozen_now):
    history = _historical_refund()
    refund = rows(frozen_now)[1]
    fields = [history._meta.get_field(f.attname) for f in history.tracked_fields]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        theirs = [field.get_db_prep_save(getattr(refund, field.attname), connection) for field in fields]
        ours = Prepared(fields)(refund)
    same(ours, theirs)


def test_the_policy_read_as_json_makes_the_orms_instances(policy):
    """selectors.policy_in_force builds the limits and hold rules from row_to_json, taking a value
    as it is where the field's to_python would: the same attributes, of the same types, as the ORM's."""
    from refundops.models import PolicyDraft
    from refundops.selectors import active_limits, active_rules, policy_in_force, shadow_drafts

    PolicyDraft.objects.create(kind=PolicyDraft.Kind.RULES, shadow=True, created_by="t",
                               values={"velocity_window_hours": 12})
    limits, rules, drafts = policy_in_force("USD")
    for ours, theirs in [(limits, active_limits("USD")), (rules, active_rules()),
                         *zip(drafts, shadow_drafts("USD"), strict=True)]:
        mine = {k: (type(v), v) for k, v in vars(ours).items() if k != "_state"}
        orm = {k: (type(v), v) for k, v in vars(theirs).items() if k != "_state"}
        assert mine == orm and ours._state.db == theirs._state.db and not ours._state.adding

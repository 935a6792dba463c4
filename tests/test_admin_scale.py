"""Finance's and auditors' lists stay cheap as the tables grow (issue 31): the shape of their queries.

Timing lives in bench/admin_scale.py; here each page is held to the queries that keep it fast at a
million rows: an id or an email is looked up with ``=`` on an index, not ``LIKE`` across joins; an
unfiltered list is not counted row by row; the held queue is read a page at a time.
"""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from audit.models import AuditEntry
from audit.services import record_audit
from refundops.models import IdempotencyRecord, Payment, Refund, RefundState
from tests.browser import make_approver, populate

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(db):
    return populate()


@pytest.fixture
def finance(client):
    client.force_login(make_approver(limit=100_000))
    return client


def get_with_queries(client, url: str) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200
    return response.content.decode(), [q["sql"] for q in captured.captured_queries]


def plan(queryset) -> str:
    """The plan PostgreSQL picks when a sequential scan is its last resort: names the index if one serves."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        try:
            return queryset.explain()
        finally:
            cursor.execute("SET LOCAL enable_seqscan = on")


def test_refunds_searched_by_an_id_or_an_email_compare_with_equals_not_like(finance, world):
    refund = Refund.objects.select_related("payment__customer").get(pk=world.held.pk)
    url = reverse("admin:refundops_refund_changelist")
    for term, column in ((refund.pk, '"refundops_refund"."id" = '),
                         (refund.payment_id, '"refundops_refund"."payment_id" = '),
                         (refund.payment.customer_id, '"refundops_payment"."customer_id" = '),
                         (refund.verdict_id, '"refundops_refund"."verdict_id" = '),
                         (refund.payment.customer.email.upper(), 'UPPER("refundops_customer"."email"::text) = ')):
        page, queries = get_with_queries(finance, f"{url}?q={term}")
        searched = [q for q in queries if term in q]  # the count, the page, the date drill-down
        assert searched and all(column in q and " LIKE " not in q for q in searched), (term, searched)
        assert refund.pk in page and world.held_big.pk not in page


def test_a_partial_id_or_a_word_still_searches_as_before(finance, world):
    url = reverse("admin:refundops_refund_changelist")
    page, queries = get_with_queries(finance, f"{url}?q={world.held.pk[:8]}")
    assert world.held.pk in page and any(" LIKE " in q for q in queries)


def test_the_customer_email_search_is_served_by_an_index(world):
    from refundops.models import Customer

    assert "customer_email_ci" in plan(Customer.objects.filter(email__iexact="someone@example.com"))


def test_the_audit_log_searched_by_a_payment_id_finds_it_in_data_or_as_subject_through_indexes(client, world):
    refund = Refund.objects.get(pk=world.held.pk)
    record_audit(actor="system:test", action="test.mentions", subject_type="dispute", subject_id="dp_x",
                 data={"payment_id": refund.payment_id})
    client.force_login(make_approver("auditor-ish", limit=100_000))
    page, queries = get_with_queries(client, f"{reverse('admin:audit_auditentry_changelist')}?q={refund.payment_id}")
    searched = [q for q in queries if refund.payment_id in q]
    assert searched and all(" LIKE " not in q and "-> 'payment_id'" in q for q in searched), searched
    assert "test.mentions" in page
    model_admin = admin.site._registry[AuditEntry]
    found, _ = model_admin.get_search_results(None, AuditEntry.objects.all(), refund.payment_id)
    shown = plan(found)
    assert "audit_entry_data_payment" in shown and "audit_auditentry_subject_id" in shown, shown


@pytest.mark.parametrize("list_url", ["admin:refundops_refund_changelist", "admin:refundops_payment_changelist",
                                      "admin:audit_verdict_changelist", "admin:audit_auditentry_changelist",
                                      "admin:refundops_idempotencyrecord_changelist"])
def test_a_long_list_is_not_counted_row_by_row(finance, admin_client, world, settings, list_url):
    settings.ADMIN_ESTIMATED_COUNT_ABOVE = 1  # "long", brought down to the test's few rows
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # the statistics autovacuum keeps
    url = reverse(list_url)
    # The refund list's default (denied requests left out) is a filter over nearly every row too.
    reader = admin_client if "idempotency" in list_url else finance  # operators' and auditors' page
    for shown in (url, *([f"{url}?status__exact=all"] if "refund_" in list_url else [])):
        _, queries = get_with_queries(reader, shown)
        assert [q for q in queries if "COUNT(*)" in q] == []
        assert any(q.startswith("EXPLAIN") for q in queries), [q[:60] for q in queries]


def test_a_short_list_is_still_counted_exactly(finance, world, settings):
    settings.ADMIN_ESTIMATED_COUNT_ABOVE = 1_000
    page, queries = get_with_queries(finance, f"{reverse('admin:refundops_refund_changelist')}?status__exact=held")
    assert any("COUNT(*)" in q and "WHERE" in q for q in queries)
    assert "2 refunds" in page


def test_the_held_queue_is_read_a_page_at_a_time_oldest_first(finance, world, monkeypatch):
    monkeypatch.setattr(admin.site._registry[Refund], "list_per_page", 1)
    queue = reverse("admin:refundops_refund_held")
    first, queries = get_with_queries(finance, queue)
    assert world.held.pk in first and world.held_big.pk not in first
    assert "2 refunds waiting" in first and "?p=2" in first
    assert any('FROM "refundops_refund"' in q and "LIMIT 1" in q for q in queries)
    second, _ = get_with_queries(finance, f"{queue}?p=2")
    assert world.held_big.pk in second and world.held.pk not in second
    assert Refund.objects.filter(status=RefundState.HELD).count() == 2


LISTS = ["admin:refundops_refund_changelist", "admin:refundops_payment_changelist", "admin:audit_verdict_changelist",
         "admin:audit_auditentry_changelist", "admin:refundops_agentread_changelist",
         "admin:refundops_idempotencyrecord_changelist"]


@pytest.mark.parametrize("list_url", LISTS)
def test_a_list_reads_no_whole_table_for_its_filters_or_dates(admin_client, world, list_url):
    """A filter's choices and the dates are not a DISTINCT over every row (RelatedOnly and AllValues
    filters, the date drill-down's DISTINCT years), nor a MIN/MAX over an unindexed date."""
    _, queries = get_with_queries(admin_client, reverse(list_url))
    assert [q for q in queries if "DISTINCT" in q.upper() or "MIN(" in q or "MAX(" in q] == []


def test_idempotency_records_searched_by_a_key_or_a_scope_compare_with_equals_not_like(admin_client, world):
    from refundops.models import IdempotencyRecord

    record = IdempotencyRecord.objects.order_by("created_at").first()
    url = reverse("admin:refundops_idempotencyrecord_changelist")
    for term in (record.key, record.scope):
        page, queries = get_with_queries(admin_client, f"{url}?q={term}")
        searched = [q for q in queries if term in q]
        assert searched and all(" LIKE " not in q and '"key" = ' in q for q in searched), searched
        assert record.key in page
    page, _ = get_with_queries(admin_client, f"{url}?q={record.key[:-1]}")
    assert f">{record.key}<" not in page  # a fragment is not a key


def test_the_audit_action_filter_still_lists_every_action_read_through_its_index(client, world):
    record_audit(actor="system:test", action="key.rarely_seen", subject_type="agent_key", subject_id="rk_x", data={})
    client.force_login(make_approver("auditor-ish", limit=100_000))
    page, queries = get_with_queries(client, reverse("admin:audit_auditentry_changelist"))
    shown = set(AuditEntry.objects.values_list("action", flat=True))
    assert len(shown) > 3 and all(f"?action={action}" in page for action in shown)
    assert any("WITH RECURSIVE" in q and '"action"' in q for q in queries)


def test_a_currency_filter_lists_the_recent_currencies_and_the_one_chosen(finance, world, monkeypatch):
    from audit.admin import RecentValuesListFilter

    url = reverse("admin:refundops_refund_changelist")
    page, _ = get_with_queries(finance, f"{url}?status__exact=all")
    assert "currency=EUR" in page and "currency=USD" in page
    monkeypatch.setattr(RecentValuesListFilter, "RECENT_ROWS", 1)  # the latest refund only
    latest = Refund.objects.order_by("-created_at", "-id").first()
    other = "USD" if latest.currency == "EUR" else "EUR"
    page, _ = get_with_queries(finance, f"{url}?status__exact=all&currency={other}")
    assert f"currency={latest.currency}" in page and f"currency={other}" in page


def test_a_deep_page_joins_only_its_own_rows(finance, world, monkeypatch):
    """OFFSET walks the skipped rows in the ordering's index, inside a sub-select of keys; only the
    page's rows are joined to their payments, customers and agents."""
    monkeypatch.setattr(admin.site._registry[Refund], "list_per_page", 1)
    url = f"{reverse('admin:refundops_refund_changelist')}?status__exact=all&p=2"
    page, queries = get_with_queries(finance, url)
    paged = [q for q in queries if "OFFSET" in q]
    assert paged, queries
    for sql in paged:
        inner = sql[sql.index("IN (SELECT"):sql.index("OFFSET")]
        assert "JOIN" not in inner and "JOIN" in sql[:sql.index("IN (SELECT")], sql
    newest_first = list(Refund.objects.order_by("-created_at", "-id").values_list("pk", flat=True))
    assert newest_first[1] in page and newest_first[0] not in page


@pytest.mark.parametrize("queryset, index", [
    (lambda: Refund.objects.order_by("amount_minor", "-id")[:100], "refund_amount_order"),
    (lambda: Refund.objects.order_by("-amount_minor", "-id")[:100], "refund_amount_order"),
    (lambda: Payment.objects.order_by("-created_at", "-id")[:100], "payment_created_order"),
    (lambda: IdempotencyRecord.objects.order_by("-created_at", "-id")[:100], "idempotency_created_order"),
])
def test_the_lists_orderings_are_read_along_an_index(world, queryset, index):
    assert index in plan(queryset())


def test_the_dashboard_finds_people_decisions_paid_twice_and_disputes_through_small_indexes(finance, world):
    """Not the whole audit log for the few entries people wrote, nor every payment for the few paid
    twice or disputed (a DISTINCT over payments joined to their refunds, before)."""
    _, queries = get_with_queries(finance, reverse("admin:refundops_dashboard"))
    assert [q for q in queries if "DISTINCT" in q.upper()] == []
    wanted = {"audit_entry_people": "LIKE 'user:%'", "payment_paid_twice": '"refundops_payment"."paid_twice"',
              "payment_dispute_open": '"refundops_payment"."dispute_status" ='}
    for index, marker in wanted.items():
        found = [q for q in queries if marker in q]
        assert found, (index, queries)
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            for sql in found:
                cursor.execute(f"EXPLAIN {sql}")
                assert index in "\n".join(row[0] for row in cursor.fetchall()), sql
            cursor.execute("SET LOCAL enable_seqscan = on")

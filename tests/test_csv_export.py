"""An auditor exports any admin list as CSV, exactly as filtered on screen (filters, search, date
drill-down, ordering; every page, not just the one shown), and an object's history. The export
streams: memory stays flat however many rows there are. Each export is in the audit chain.
(Issue 9: "auditor (read-only everywhere, CSV export of any filtered list)".)"""

from __future__ import annotations

import asyncio
import csv
import io
import tracemalloc
import uuid
import warnings

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.handlers.asgi import ASGIHandler
from django.core.management import call_command
from django.db import connection, connections
from django.test import Client

from audit import exports
from audit.models import AuditEntry, Verdict
from audit.services import record_audit
from refundops.asgi_handler import DjangoHandler
from refundops.callers import Caller
from refundops.models import Refund
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = pytest.mark.django_db

A_PASSWORD = "correct horse battery staple 42"


def signed_in(role: str, username: str = "") -> Client:
    username = username or f"as-{role.replace(' ', '-')}"
    User.objects.create_user(username, password="pw")
    call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    client = Client()
    client.force_login(User.objects.get(username=username))
    return client


def rows_of(response) -> list[dict[str, str]]:
    assert response.status_code == 200, response
    assert response.streaming
    text = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(text)))


def agent_refund(payment, amount: int) -> dict:
    return request_refund(caller=Caller.for_key(make_agent_key()[0]), idempotency_key=uuid.uuid4().hex,
                          data={"transaction_id": payment.pk, "amount": amount, "reason": "customer_request"}).body


def test_the_auditor_exports_the_refund_list_as_filtered_on_screen_every_page_of_it():
    make_limits(approval_threshold_minor=5_000)
    make_rules()
    held = [agent_refund(make_payment(amount=20_000), 9_000)["refund"] for _ in range(3)]
    approved = [agent_refund(make_payment(amount=20_000), 1_000)["refund"] for _ in range(2)]
    auditor = signed_in("auditor")

    response = auditor.get("/admin/refundops/refund/export.csv?status__exact=held&p=2")
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"].startswith('attachment; filename="refundops-refund-')
    rows = rows_of(response)
    assert sorted(row["id"] for row in rows) == sorted(r["id"] for r in held)
    assert {(row["status"], row["amount_minor"], row["currency"]) for row in rows} == {("held", "9000", "USD")}
    assert rows[0]["payment"] == Refund.objects.get(pk=rows[0]["id"]).payment_id  # a relation: its id

    # The search box and the ordering apply too.
    one = approved[0]
    assert [row["id"] for row in rows_of(auditor.get(f"/admin/refundops/refund/export.csv?q={one['id']}"))] \
        == [one["id"]]
    ordered = rows_of(auditor.get("/admin/refundops/refund/export.csv?o=1"))  # by amount (column 1 from 0), ascending
    assert [int(row["amount_minor"]) for row in ordered] == [1_000, 1_000, 9_000, 9_000, 9_000]

    # The changelist links to the export of what it shows.
    page = auditor.get("/admin/refundops/refund/?status__exact=held").content.decode()
    assert 'href="/admin/refundops/refund/export.csv?status__exact=held"' in page


def test_the_audit_log_and_verdicts_export_with_their_filters_and_the_export_itself_is_audited():
    for n in range(3):
        record_audit(actor="user:someone", action="key.revoked" if n else "key.issued", subject_type="agent_key",
                     subject_id=f"key-{n}", data={"n": n})
    Verdict.objects.create(operation="refund.create", outcome="denied", code="OVER_LIMIT", checks=[{"name": "x"}])
    Verdict.objects.create(operation="refund.create", outcome="approved")
    auditor = signed_in("auditor", "audra")

    entries = rows_of(auditor.get("/admin/audit/auditentry/export.csv?action__exact=key.revoked"))
    assert sorted(row["subject_id"] for row in entries) == ["key-1", "key-2"]
    assert entries[0]["data"] in ('{"n": 1}', '{"n": 2}')  # JSON as JSON, not a Python repr
    assert set(entries[0]) >= {"seq", "created_at", "actor", "action", "mac", "prev_hash", "hash"}

    verdicts = rows_of(auditor.get("/admin/audit/verdict/export.csv?outcome__exact=denied"))
    assert [(v["outcome"], v["code"], v["checks"]) for v in verdicts] == [("denied", "OVER_LIMIT", '[{"name": "x"}]')]

    exported = AuditEntry.objects.filter(action="admin_list.exported", actor="user:audra").order_by("id")
    assert [(e.subject_id, e.data["filters"]) for e in exported] == [
        ("audit.AuditEntry", "action__exact=key.revoked"), ("audit.Verdict", "outcome__exact=denied")]


def test_an_objects_history_exports_every_version():
    make_limits(approval_threshold_minor=5_000)
    make_rules()
    refund = agent_refund(make_payment(amount=20_000), 9_000)["refund"]
    auditor = signed_in("auditor")
    rows = rows_of(auditor.get(f"/admin/refundops/refund/{quote(refund['id'])}/history/export.csv"))
    assert rows and {row["id"] for row in rows} == {refund["id"]}
    assert {"history_id", "history_date", "history_type", "history_user", "status"} <= set(rows[0])
    page = auditor.get(f"/admin/refundops/refund/{quote(refund['id'])}/history/").content.decode()
    assert "history/export.csv" in page


def test_only_someone_who_may_see_a_list_may_export_it():
    make_agent_key()
    assert signed_in("fraud analyst").get("/admin/refundops/agentkey/export.csv").status_code == 403
    assert signed_in("operator").get("/admin/refundops/agentkey/export.csv").status_code == 200
    anonymous = Client().get("/admin/refundops/agentkey/export.csv")
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous.url
    assert not AuditEntry.objects.filter(action="admin_list.exported", actor="user:as-fraud-analyst").exists()


def test_a_cell_that_a_spreadsheet_would_run_as_a_formula_is_exported_as_text():
    Verdict.objects.create(operation="refund.create", outcome="denied", agent_name="=HYPERLINK(\"http://x\")",
                           message="+1 wrong", staff_username="@SUM(A1)", amount_minor=-500, currency="USD")
    row, = rows_of(signed_in("auditor").get("/admin/audit/verdict/export.csv"))
    assert (row["agent_name"], row["message"], row["staff_username"], row["amount_minor"]) == (
        "'=HYPERLINK(\"http://x\")", "'+1 wrong", "'@SUM(A1)", "-500")  # a number stays a number


def test_a_bad_filter_is_refused_with_a_message_not_a_server_error():
    response = signed_in("auditor").get("/admin/refundops/refund/export.csv?no_such_field=1")
    assert response.status_code == 400 and b"filter" in response.content


def insert_verdicts(count: int) -> None:
    """``count`` verdicts in one statement: the first made by the ORM (so a column added later gets
    its default), the rest copied from it with what varies per row."""
    Verdict.objects.create(id="vd_1", operation="refund.create", outcome="held", message="within every limit",
                           agent_id="ag_1", agent_name="support-bot", key_prefix="rk_1234", idempotency_key="key-1",
                           payment_id="txn_1", refund_id="rf_1", amount_minor=1, currency="USD",
                           request={"amount": 1, "reason": "customer_request"},
                           checks=[{"name": "amount", "result": "pass", "limit": 50000, "observed": 1,
                                    "inputs": {"n": 1}}], policy_version="limits v1 / rules v1")
    varying = {
        "id": "'vd_' || n", "created_at": "now() - n * interval '1 second'",
        "outcome": "CASE WHEN n %% 2 = 0 THEN 'approved' ELSE 'held' END", "idempotency_key": "'key-' || n",
        "payment_id": "'txn_' || n", "refund_id": "'rf_' || n", "amount_minor": "n",
        "request": "jsonb_build_object('amount', n, 'reason', 'customer_request')",
        "checks": "jsonb_build_array(jsonb_build_object('name', 'amount', 'result', 'pass', 'limit', 50000, "
                  "'observed', n, 'inputs', jsonb_build_object('n', n)))",
    }
    columns = [f.column for f in Verdict._meta.concrete_fields]
    with connection.cursor() as cursor:
        cursor.execute(f"""
            INSERT INTO audit_verdict ({", ".join(columns)})
            SELECT {", ".join(varying.get(c, f"t.{c}") for c in columns)}
            FROM generate_series(2, %s) AS n, audit_verdict t WHERE t.id = 'vd_1'""", [count])


def test_exporting_a_hundred_thousand_rows_streams_in_constant_memory():
    insert_verdicts(100_000)
    auditor = signed_in("auditor")
    # Once untraced, so what the first request of a process loads (templates, URL patterns) is not counted.
    assert len(rows_of(auditor.get("/admin/audit/verdict/export.csv?q=vd_99999"))) == 1

    tracemalloc.start()
    try:
        response = auditor.get("/admin/audit/verdict/export.csv")
        assert response.streaming
        lines = size = 0
        for chunk in response.streaming_content:
            lines += chunk.count(b"\n")
            size += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lines == 100_001  # the header and every row
    assert size > 25 * 2**20
    assert peak < 12 * 2**20, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB export"


# Constant memory is proven at 100,000 rows once, above; here it is enough that the export goes out in
# chunks while it is read and never whole: at most a third of its size is in memory at once. In chunks
# of ASGI_CHUNK_ROWS rather than the export's 1,000: what one chunk holds (its rows, their JSON) is what
# is in memory besides, 3.8 MiB at 1,000 rows and 1.3 MiB at 100, so the third is met by 16,000 rows
# (5.6 MiB) rather than 40,000 (14 MiB); an export read whole first peaks at 6.2 MiB, above the whole.
ASGI_ROWS = 16_000
ASGI_CHUNK_ROWS = 100


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("handler", [ASGIHandler, lambda: DjangoHandler(threads=1)], ids=["django", "deployed"])
def test_under_the_asgi_server_the_export_streams_too(handler, monkeypatch):
    """Under ASGI (gunicorn's UvicornWorker, as deployed) Django reads a synchronous iterator into
    one list before sending a byte; the export hands it an asynchronous one, which reads its cursor
    on the request's thread (refundops.asgi's handler: a thread it keeps, leased for the request)."""
    insert_verdicts(ASGI_ROWS)
    client = signed_in("auditor")
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    # As under the pool refundops.asgi has: the request's connection closed as it finishes, not kept
    # open by the handler's thread past the test.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    monkeypatch.setattr(exports, "CHUNK_ROWS", ASGI_CHUNK_ROWS)
    app = handler()

    def export(query: bytes) -> dict:
        sent = {"status": None, "chunks": 0, "bytes": 0, "lines": 0, "headers": {}}

        async def receive():
            if sent["status"] is None and not sent.get("asked"):
                sent["asked"] = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()  # the client never goes away

        async def send(message):
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                sent["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
            elif message.get("body"):
                sent["chunks"] += 1
                sent["bytes"] += len(message["body"])
                sent["lines"] += message["body"].count(b"\n")

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/admin/audit/verdict/export.csv",
                 "raw_path": b"/admin/audit/verdict/export.csv", "query_string": query, "root_path": "",
                 "server": ("testserver", 80), "client": ("127.0.0.1", 5000),
                 "headers": [(b"host", b"testserver"), (b"cookie", cookie.encode())]}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "StreamingHttpResponse must consume synchronous iterators"
            async_to_sync(app)(scope, receive, send)
        return sent

    # Once untraced, so what the first request of a process loads (templates, URL patterns) is not counted.
    assert export(f"q=vd_{ASGI_ROWS - 1}".encode())["lines"] == 2  # the header and one row
    tracemalloc.start()
    try:
        sent = export(b"")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent["status"] == 200 and sent["headers"]["Content-Type"] == "text/csv; charset=utf-8"
    assert sent["lines"] == ASGI_ROWS + 1 and sent["chunks"] > 100
    assert peak < sent["bytes"] / 3, f"peak {peak / 2**20:.1f} MiB for a {sent['bytes'] / 2**20:.1f} MiB export"


def test_no_export_carries_a_secret_a_password_hash_a_totp_key_or_a_signing_secret():
    """The admin never shows these (a password as a masked summary, a TOTP key not at all, an
    endpoint's secret as a hint), and the export of the same list must not either, to anyone."""
    from django.contrib import admin
    from django_otp.plugins.otp_totp.models import TOTPDevice

    from refundops.models import MerchantEndpoint

    root = User.objects.create_superuser("root", password=A_PASSWORD)
    device = TOTPDevice.objects.create(user=root, name="phone", confirmed=True)
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks", secret="whsec_" + "s3cr3t" * 6)
    agent_key, _ = make_agent_key()
    secrets = [root.password, device.key, endpoint.secret, agent_key.key_hash]
    superuser = Client()
    superuser.force_login(root)
    for client in (signed_in("auditor"), superuser):
        for model in admin.site._registry:
            opts = model._meta
            response = client.get(f"/admin/{opts.app_label}/{opts.model_name}/export.csv")
            body = b"".join(response.streaming_content).decode()
            header = body.splitlines()[0].split(",")
            secret_columns = {"password", "secret", "key_hash"} | ({"key"} if opts.label == "otp_totp.TOTPDevice" else set())
            assert not secret_columns & set(header), (opts.label, header)
            assert not [s for s in secrets if s in body], opts.label

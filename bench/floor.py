"""The bare floor: the least a correct refund write costs through Django on this machine. Lock the
payment row, sum what was refunded on it, insert one refund, commit: raw SQL on a connection that
stays open, on a table of the benchmark's own (``bench_floor_refund``, created by bench/refunds.py
when it seeds, not a migration). No DRF, no middleware (bench.settings_floor), no ORM model save,
no signals, no history, no key, no policy, no verdict, no audit, no idempotency, no queue."""

from __future__ import annotations

import json

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.urls import re_path
from django.views.decorators.csrf import csrf_exempt

TABLE = "bench_floor_refund"
CREATE_TABLE = [
    f"DROP TABLE IF EXISTS {TABLE}",
    f"""CREATE TABLE {TABLE} (
        id bigserial PRIMARY KEY,
        payment_id varchar(40) NOT NULL REFERENCES refundops_payment (id),
        amount_minor bigint NOT NULL CHECK (amount_minor > 0),
        currency char(3) NOT NULL,
        reason text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now())""",
    f"CREATE INDEX {TABLE}_payment ON {TABLE} (payment_id)",
]


@csrf_exempt
def floor_refund(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return JsonResponse({"error": "POST only"}, status=405)
    data = json.loads(request.body)
    payment_id, amount = str(data["transaction_id"]), int(data["amount"])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT amount_captured_minor, currency FROM refundops_payment WHERE id = %s FOR UPDATE",
                       [payment_id])
        row = cursor.fetchone()
        if row is None:
            return JsonResponse({"error": "no such payment"}, status=404)
        captured, currency = row
        cursor.execute(f"SELECT COALESCE(SUM(amount_minor), 0) FROM {TABLE} WHERE payment_id = %s", [payment_id])
        if cursor.fetchone()[0] + amount > captured:
            return JsonResponse({"error": "exceeds captured"}, status=422)
        cursor.execute(f"INSERT INTO {TABLE} (payment_id, amount_minor, currency, reason) VALUES (%s, %s, %s, %s) "
                       "RETURNING id", [payment_id, amount, currency, str(data["reason"])])
        refund_id = cursor.fetchone()[0]
    return JsonResponse({"id": refund_id, "status": "approved"}, status=201)


urlpatterns = [re_path(r"^api/v1/refunds/?$", floor_refund)]

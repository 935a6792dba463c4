"""Merchant webhooks out: a signed POST to each active endpoint on every refund state change.

The service that changes a refund calls :func:`announce_refund` in its transaction: the deliveries,
and the outbox rows that send them, are written with the change, so a rolled-back change is never
announced and a committed one always is, also when the broker is down at commit. Each delivery
is attempted by ``refundops.tasks.deliver_webhook`` with exponential backoff and jitter, logged
attempt by attempt, swept up by :func:`deliver_overdue` if its task was lost, and can be sent again
by hand (:func:`redeliver`).

Settings (optional): ``WEBHOOK_MAX_ATTEMPTS`` (10), ``WEBHOOK_BACKOFF_BASE_SECONDS`` (10),
``WEBHOOK_BACKOFF_MAX_SECONDS`` (21600), ``WEBHOOK_TIMEOUT_SECONDS`` (10: the whole call's deadline),
``WEBHOOK_OVERDUE_SECONDS`` (300).
Calls go through :mod:`refundops.merchant_http`: public addresses only, checked at connect time.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, Subquery
from django.utils import timezone

from audit.ids import new_id
from audit.services import record_audit
from processors import signing
from refundops import batching, logs, merchant_http, outbox
from refundops.answers import refund_json
from refundops.models import MerchantEndpoint, Payment, Refund, WebhookDelivery
from refundops.rows import Columns

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "RefundOps-Signature"
DELIVER_TASK = "refundops.tasks.deliver_webhook"
DEFAULTS: dict[str, float] = {"WEBHOOK_MAX_ATTEMPTS": 10, "WEBHOOK_BACKOFF_BASE_SECONDS": 10,
                              "WEBHOOK_BACKOFF_MAX_SECONDS": 6 * 3600, "WEBHOOK_TIMEOUT_SECONDS": 10,
                              "WEBHOOK_OVERDUE_SECONDS": 300}


def _setting(name: str) -> float:
    return float(getattr(settings, name, DEFAULTS[name]))


def announce_refund(refund: Refund, *, previous: str | None,
                    endpoints: list[MerchantEndpoint] | None = None) -> list[WebhookDelivery]:
    """Queue the event for the state ``refund`` was just saved in, having left ``previous`` (None:
    a new refund). Call it in the transaction that saved the change, once per state moved into.
    ``endpoints``: :func:`active_endpoints` read earlier in this same transaction (a service that
    moves one refund twice reads them once)."""
    event_type = f"refund.{refund.status}"
    endpoints = [e for e in (active_endpoints(refund) if endpoints is None else endpoints) if e.wants(event_type)]
    if not endpoints:
        return []
    now = timezone.now()
    event_id = new_id("evt")
    payload = {"id": event_id, "object": "event", "type": event_type, "created": int(now.timestamp()),
               "data": {"object": {**refund_json(refund), "origin": refund.origin,
                                   "processor_refund_id": refund.processor_refund_id or None,
                                   "failure_code": refund.failure_code or None},
                        "previous_status": previous}}
    deliveries = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(endpoint=endpoint, event_id=event_id, event_type=event_type, payload=payload,
                        next_attempt_at=now) for endpoint in endpoints)
    outbox.send_each_after_commit(DELIVER_TASK, [{"delivery_id": delivery.pk} for delivery in deliveries])
    return deliveries


_ENDPOINT = Columns(MerchantEndpoint, "e")


@functools.cache
def _endpoints_sql() -> str:
    """``active_endpoints``' statement, made once: the same string every time (not rebuilt, nor
    hashed anew by the prepared statements' look-ups, on every refund)."""
    return (
        f"SELECT {_ENDPOINT.sql} FROM {MerchantEndpoint._meta.db_table} e WHERE e.active AND e.merchant_id = "
        f"(SELECT merchant_id FROM {Payment._meta.db_table} WHERE id = %s) ORDER BY e.id")


def active_endpoints(refund: Refund, *, deferred: bool = False) -> list[MerchantEndpoint]:
    """The active endpoints of the refund's payment's merchant, in one query (a subquery for the
    merchant, not another statement). Every refund reads them, and usually finds none: on
    PostgreSQL hand-written (refundops.rows), which spares the ~1 ms of Python compiling the ORM's
    query takes; the ORM's query elsewhere (SQLite). ``deferred``: in a batch (refundops.batching)
    the read rides with the next statement, and the list returned is filled when that is back."""
    if connection.vendor != "postgresql":
        merchant = Payment.objects.filter(pk=refund.payment_id).values("merchant_id")[:1]
        return list(MerchantEndpoint.objects.filter(active=True, merchant_id=Subquery(merchant)))
    endpoints: list[MerchantEndpoint] = []
    sql = _endpoints_sql()

    def read(cursor) -> None:
        endpoints.extend(_ENDPOINT.make(row) for row in cursor.fetchall())

    if deferred:
        batching.defer(sql, [refund.payment_id], then=read)
    else:
        with connection.cursor() as cursor:
            cursor.execute(sql, [refund.payment_id])
            read(cursor)
    return endpoints


def deliver_overdue(*, older_than_seconds: float | None = None, limit: int = 500) -> int:
    """Pending deliveries whose next attempt is ``WEBHOOK_OVERDUE_SECONDS`` overdue: their task was
    lost (a broker restart, a worker killed between retries), or is still queued behind a backlog;
    the sweep cannot tell which. Each is sent again through the outbox, and its next attempt moved
    as far past now as the delivery is old (at most ``WEBHOOK_BACKOFF_MAX_SECONDS``): one queued
    behind a backlog is sent again a few times, not every sweep (each copy would lengthen the
    backlog it waits in); one whose task was lost is sent again at once."""
    if older_than_seconds is None:
        older_than_seconds = _setting("WEBHOOK_OVERDUE_SECONDS")
    now = timezone.now()
    with transaction.atomic():
        due = list(WebhookDelivery.objects.select_for_update(skip_locked=True)
                   .filter(status=WebhookDelivery.Status.PENDING,
                           next_attempt_at__lte=now - timedelta(seconds=older_than_seconds))
                   .order_by("next_attempt_at").only("pk", "created_at", "next_attempt_at")[:limit])
        longest = timedelta(seconds=_setting("WEBHOOK_BACKOFF_MAX_SECONDS"))
        for delivery in due:
            delivery.next_attempt_at = now + min(max(now - delivery.created_at, timedelta(seconds=older_than_seconds)),
                                                 longest)
        WebhookDelivery.objects.bulk_update(due, ["next_attempt_at"])
        ids = [delivery.pk for delivery in due]
        # Each copy carries the turn it was given: it may claim it at once, an older copy may not.
        outbox.send_each_after_commit(DELIVER_TASK, [{"delivery_id": delivery.pk,
                                                      "turn": delivery.next_attempt_at.isoformat()}
                                                     for delivery in due])
    if ids:
        log.warning("webhooks: %s deliveries were overdue (their task was lost); sent again", len(ids))
    return len(ids)


def body_bytes(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def backoff_seconds(attempts: int) -> float:
    """Exponential with full jitter: ``base * 2**(attempts-1)``, capped, between half and all of it."""
    ceiling = min(_setting("WEBHOOK_BACKOFF_MAX_SECONDS"),
                  _setting("WEBHOOK_BACKOFF_BASE_SECONDS") * 2 ** max(attempts - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


def attempt_delivery(*, delivery_id: str, turn: datetime | None = None) -> WebhookDelivery | None:
    """POST one pending delivery once and record the answer; ``None`` when it is not this copy's turn.

    A delivery's message can be handed out more than once (a worker killed, the broker's visibility
    timeout under a backlog, the overdue sweep's copy), so each copy first claims the delivery's
    turn in one statement: the delivery is due (or the sweep gave this copy ``turn``, the time it
    moved the delivery to), and the claim moves it a call's length ahead. A copy that finds the turn
    taken or not yet come sends nothing: one POST a turn, however many copies. No lock is held over
    the call; the endpoint may still see an event twice (a call that timed out) and is told so by its id."""
    now = timezone.now()
    due = Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now)
    if turn is not None:
        due |= Q(next_attempt_at=turn)
    lease = timedelta(seconds=2 * _setting("WEBHOOK_TIMEOUT_SECONDS"))  # a copy that died mid-call: due again
    if not WebhookDelivery.objects.filter(due, pk=delivery_id, status=WebhookDelivery.Status.PENDING).update(
            next_attempt_at=now + lease):
        return None
    delivery = WebhookDelivery.objects.select_related("endpoint").get(pk=delivery_id)
    body = body_bytes(delivery.payload)
    # Only the status and the answer's size are kept: the body is the merchant's (or, for a URL
    # that points somewhere it should not, someone else's) and is never stored or shown.
    answer = merchant_http.post(
        delivery.endpoint.url, body, deadline_seconds=_setting("WEBHOOK_TIMEOUT_SECONDS"),
        headers={"Content-Type": "application/json", "User-Agent": "RefundOps-Webhooks/1",
                 logs.REQUEST_ID_HEADER: logs.current_request_id(),
                 SIGNATURE_HEADER: signing.sign(body, delivery.endpoint.secret)})
    code, error = answer.status, answer.error
    return _record_attempt(delivery, code=code, error=error)


def _record_attempt(delivery: WebhookDelivery, *, code: int | None, error: str) -> WebhookDelivery:
    """Record one attempt's answer in one statement (no transaction, no row lock: one round trip
    where a burst of deliveries spent four). Only a delivery still pending is written, so an
    attempt that raced another one (the overdue sweep's) never undoes a delivery; the count of
    attempts is the database's own, the give-up decision this attempt's reading of it."""
    now = timezone.now()
    delivery.attempts += 1
    delivery.response_code, delivery.last_error = code, error
    if not error:
        delivery.status, delivery.delivered_at, delivery.next_attempt_at = (
            WebhookDelivery.Status.DELIVERED, now, None)
    elif delivery.attempts >= _setting("WEBHOOK_MAX_ATTEMPTS"):
        delivery.status, delivery.next_attempt_at = WebhookDelivery.Status.FAILED, None
        log.error("webhook %s to %s: giving up after %s attempts (%s)", delivery.pk,
                  delivery.endpoint_id, delivery.attempts, error)
    else:
        delivery.next_attempt_at = now + timedelta(seconds=backoff_seconds(delivery.attempts))
    written = WebhookDelivery.objects.filter(pk=delivery.pk, status=WebhookDelivery.Status.PENDING).update(
        attempts=F("attempts") + 1, status=delivery.status, delivered_at=delivery.delivered_at,
        next_attempt_at=delivery.next_attempt_at, response_code=code, last_error=error)
    if not written:  # another attempt finished it meanwhile: that one's record stands
        delivery.refresh_from_db()
    return delivery


@transaction.atomic
def redeliver(delivery_id: str, *, actor: str = "system:operator") -> WebhookDelivery:
    """Send a delivery again (failed, or delivered but lost by the merchant): same event, same id."""
    delivery = WebhookDelivery.objects.select_for_update().get(pk=delivery_id)
    before = delivery.status
    delivery.status, delivery.next_attempt_at, delivery.last_error = (
        WebhookDelivery.Status.PENDING, timezone.now(), "")
    delivery.save(update_fields=["status", "next_attempt_at", "last_error"])
    record_audit(actor=actor, action="webhook.redelivered", subject_type="webhook_delivery",
                 subject_id=delivery.pk, data={"from": before, "event_id": delivery.event_id,
                                               "endpoint_id": delivery.endpoint_id})
    outbox.send_after_commit(DELIVER_TASK, {"delivery_id": delivery.pk})
    return delivery

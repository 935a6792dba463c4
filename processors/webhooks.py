"""Inbound gateway webhooks: verify, record, hand on, answer.

``/webhooks/<gateway>/`` tries each configured account of the gateway (the one whose secret
verifies the event is the account it is about); ``/webhooks/<gateway>/<account>/`` names it.
Answers: 429 past ``RATE_LIMIT_WEBHOOK_PER_MINUTE`` deliveries from one address (not recorded);
400 for an event that does not verify (recorded, nothing else happens); 413 for a body
over ``WEBHOOK_MAX_BODY_BYTES`` or JSON nested past ``WEBHOOK_MAX_JSON_DEPTH`` (recorded, never
parsed further or verified); 200 once a
verified event is applied, or when it was applied before (a duplicate delivery); 503 when the
gateway could not be asked, to verify (PayPal) or to re-read the object, so the gateway retries.

The view lives with the gateways and knows nothing of refunds: what applying an event means is
passed in (``apply_event``) where the URLs are wired, in ``refundops.webhook_urls``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from processors.bodies import BodyTooLarge, load_json_body, sha256_hex, storable
from processors.base import InvalidWebhook, ProcessorDeclined, ProcessorUnavailable, WebhookEvent
from processors.models import InboundEvent
from processors.registry import ADAPTERS, UnknownProcessor, get_processor

log = logging.getLogger(__name__)

ApplyEvent = Callable[..., str]  # (event, *, account) -> what it did, in words
RetryAfter = Callable[..., "int | None"]  # (*, gateway, source) -> seconds to wait, or None to go on
# Only these headers are kept with an event: signatures and delivery ids, not cookies or tokens.
KEPT_HEADERS = ("stripe-signature", "sandbox-signature", "paypal-transmission-id", "paypal-transmission-time",
                "paypal-transmission-sig", "paypal-cert-url", "paypal-auth-algo", "content-type", "user-agent")


UNVERIFIED_PAYLOAD_PREFIX = 4096  # bytes of an unverified body kept for the record (with its hash)
WEBHOOK_MAX_JSON_DEPTH = 64  # gateways' events nest about ten deep


def _kept(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): storable(value, 1000) for name, value in headers.items() if name.lower() in KEPT_HEADERS}


def _claimed(body: object) -> tuple[str, str]:
    """The id and type an unverified event claims, for the record only; never acted on."""
    if not isinstance(body, dict):
        return "", ""
    return (storable(str(body.get("id") or ""), 255),
            storable(str(body.get("type") or body.get("event_type") or ""), 100))


def _payload_fields(payload: bytes, *, limit: int | None = None) -> dict[str, object]:
    kept = payload if limit is None else payload[:limit]
    return {"payload": storable(kept.decode("utf-8", "replace"), len(kept)), "payload_bytes": len(payload),
            "payload_sha256": sha256_hex(payload)}


def record_unverified(*, gateway: str, payload: bytes, headers: Mapping[str, str], error: str,
                      body: object = None, size: int | None = None) -> InboundEvent:
    """``size``: the whole body's length when only ``payload``, a prefix of it, was read."""
    event_id, event_type = _claimed(body)
    fields = _payload_fields(payload, limit=UNVERIFIED_PAYLOAD_PREFIX)
    if size is not None:
        fields.update(payload_bytes=size, payload_sha256="")  # the rest was never read: no hash of it
    return InboundEvent.objects.create(processor=gateway, event_id=event_id, type=event_type, verified=False,
                                       verification_error=storable(error, 2000), headers=_kept(headers), **fields)


def record_verified(*, event: WebhookEvent, account: str, payload: bytes,
                    headers: Mapping[str, str]) -> InboundEvent:
    """The event's one row: created on its first delivery, counted on every later one."""
    try:
        with transaction.atomic():
            return InboundEvent.objects.create(
                processor=event.processor, account=account, event_id=event.event_id, type=event.type,
                object_id=event.object_id, verified=True, headers=_kept(headers), **_payload_fields(payload))
    except IntegrityError:
        InboundEvent.objects.filter(processor=event.processor, event_id=event.event_id, verified=True) \
            .update(deliveries=F("deliveries") + 1)
        return InboundEvent.objects.get(processor=event.processor, event_id=event.event_id, verified=True)


@method_decorator(csrf_exempt, name="dispatch")  # gateways sign their events; they hold no CSRF token
class GatewayWebhookView(View):
    http_method_names = ["post"]
    gateway: str = ""
    apply_event: ApplyEvent | None = None
    retry_after: RetryAfter | None = None  # the rate limit per source, wired with apply_event

    def post(self, request: HttpRequest, account: str | None = None) -> JsonResponse:
        gateway = self.gateway
        accounts = [account] if account else list(settings.PROCESSORS.get(gateway, {}))
        if gateway not in ADAPTERS or not accounts:
            return _answer(404, "unknown_gateway", f"no configured gateway {gateway!r}")
        # Before the body is read: a flood of deliveries costs a Redis round trip each, nothing stored.
        wait = self.retry_after(gateway=gateway, source=request.META.get("REMOTE_ADDR", "")) \
            if self.retry_after else None
        if wait:
            return _answer(429, "rate_limited", "too many deliveries from this address; send them again later",
                           retry_after=wait)
        headers = dict(request.headers)
        limit = settings.WEBHOOK_MAX_BODY_BYTES
        payload = request.read(limit + 1)
        if len(payload) > limit:
            size = max(int(request.META.get("CONTENT_LENGTH") or 0), len(payload))
            return self._too_large(gateway, payload, headers, f"the body is over {limit} bytes", size=size)
        try:
            body = load_json_body(payload, max_bytes=limit, max_depth=WEBHOOK_MAX_JSON_DEPTH)
        except BodyTooLarge as exc:
            return self._too_large(gateway, payload, headers, str(exc))
        except (ValueError, UnicodeDecodeError):
            body = None  # not JSON: the gateway's check below says so, and it is recorded
        failures: list[str] = []
        for candidate in accounts:
            try:
                event = get_processor(gateway, candidate).verify_webhook(payload, headers)
            except UnknownProcessor:
                return _answer(404, "unknown_account", f"no configured account {candidate!r} for {gateway}")
            except InvalidWebhook as invalid:
                failures.append(f"{candidate}: {invalid.code}: {invalid.message}")
                continue
            except ProcessorUnavailable as away:
                log.warning("%s webhook: could not verify (%s); the gateway will retry", gateway, away.message)
                return _answer(503, away.code, "could not verify the event now; send it again later",
                               retry_after=away.retry_after)
            return self._accept(event, account=candidate, payload=payload, headers=headers)
        inbound = record_unverified(gateway=gateway, payload=payload, headers=headers, error="; ".join(failures),
                                    body=body)
        log.warning("%s webhook refused (inbound event %s): %s", gateway, inbound.pk, "; ".join(failures))
        return _answer(400, "invalid_signature", "the event's signature did not verify")

    @staticmethod
    def _too_large(gateway: str, payload: bytes, headers: Mapping[str, str], why: str, *,
                   size: int | None = None) -> JsonResponse:
        inbound = record_unverified(gateway=gateway, payload=payload, headers=headers, error=why, size=size)
        log.warning("%s webhook refused unread (inbound event %s): %s", gateway, inbound.pk, why)
        return _answer(413, "payload_too_large", f"{why}; events are never this large")

    def _accept(self, event: WebhookEvent, *, account: str, payload: bytes,
                headers: Mapping[str, str]) -> JsonResponse:
        inbound = record_verified(event=event, account=account, payload=payload, headers=headers)
        if inbound.applied_at is not None:
            return JsonResponse({"received": True, "event_id": event.event_id, "duplicate": True, "applied": True})
        assert self.apply_event is not None, "wire apply_event in the URLconf"
        try:
            outcome = self.apply_event(event, account=account)
        except ProcessorUnavailable as away:
            InboundEvent.objects.filter(pk=inbound.pk).update(error=f"{away.code}: {away.message}"[:2000])
            return _answer(503, away.code, "could not read the object from the gateway now; send it again later",
                           retry_after=away.retry_after)
        except ProcessorDeclined as refused:
            # The gateway will not show the object (deleted, another account's): retrying cannot
            # help, so the event is acknowledged and left unapplied, with why, for an operator.
            InboundEvent.objects.filter(pk=inbound.pk).update(error=f"{refused.code}: {refused.message}"[:2000])
            log.error("%s event %s not applied: %s", event.processor, event.event_id, refused.message)
            return JsonResponse({"received": True, "event_id": event.event_id, "duplicate": False,
                                 "applied": False})
        except Exception as failure:
            # Kept on the event for an operator; the gateway's retry may find it applied by then.
            InboundEvent.objects.filter(pk=inbound.pk).update(error=f"{type(failure).__name__}: {failure}"[:2000])
            raise
        # Deliveries at the same moment all apply (every applier is idempotent under its locks);
        # the first to finish records its outcome, and the others are answered as duplicates.
        first = InboundEvent.objects.filter(pk=inbound.pk, applied_at__isnull=True).update(
            applied_at=timezone.now(), outcome=outcome[:2000], error="")
        return JsonResponse({"received": True, "event_id": event.event_id, "duplicate": not first, "applied": True})


def _answer(status: int, code: str, message: str, *, retry_after: float | None = None) -> JsonResponse:
    response = JsonResponse({"error": {"code": code, "message": message}}, status=status)
    if retry_after:
        response["Retry-After"] = str(int(retry_after) or 1)
    return response

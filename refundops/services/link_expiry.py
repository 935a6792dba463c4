"""Unpaid payment links expire ``PAYMENT_LINK_EXPIRY_HOURS`` after they were sent (beat runs
``expire_payment_links``). A link is deactivated at its gateway first, so nobody can pay it once we
say it expired, and then marked expired here, which frees the owed amount for another link. A link
paid meanwhile stays paid; a gateway that does not answer leaves the link for the next run."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import record_audit
from processors.base import ProcessorDeclined, ProcessorUnavailable
from processors.registry import UnknownProcessor, get_processor
from refundops.locks import lock_payment
from refundops.models import Payment, PaymentLink

log = logging.getLogger(__name__)
ACTOR = "system:link-expiry"


def expire_payment_links(*, limit: int = 500) -> int:
    """Expire every unpaid link sent before the cutoff (oldest first); how many expired."""
    cutoff = timezone.now() - timedelta(hours=settings.PAYMENT_LINK_EXPIRY_HOURS)
    ids = list(PaymentLink.objects.filter(status=PaymentLink.Status.SENT, sent_at__lte=cutoff)
               .order_by("sent_at").values_list("pk", flat=True)[:limit])
    return sum(expire_payment_link(link_id=link_id) for link_id in ids)


def expire_payment_link(*, link_id: str) -> bool:
    link = PaymentLink.objects.select_related("payment").get(pk=link_id)
    if link.status != PaymentLink.Status.SENT:
        return False
    payment = link.payment
    if payment.processor != Payment.Processor.SANDBOX:
        if not link.processor_link_id:  # its creation never finished: a person looks at it
            log.warning("payment link %s: no %s link to deactivate; left for a person", link.pk, payment.processor)
            return False
        try:
            get_processor(payment.processor, payment.processor_account).deactivate_payment_link(
                link.processor_link_id, idempotency_key=f"refundops:{link.pk}:expire")
        except (ProcessorUnavailable, UnknownProcessor) as down:
            log.warning("payment link %s: %s did not answer (%s); expiring it next time", link.pk,
                        payment.processor, down)
            return False
        except ProcessorDeclined as refused:
            log.error("payment link %s: %s refused to deactivate it (%s)", link.pk, payment.processor, refused)
            record_audit(actor=ACTOR, action="payment_link.expiry_refused", subject_type="payment_link",
                         subject_id=link.pk, data={"gateway_code": refused.code, "message": refused.message})
            return False
    with transaction.atomic():
        lock_payment(payment.pk)  # payment first, as everywhere (refundops.locks)
        link = PaymentLink.objects.select_for_update().get(pk=link_id)
        if link.status != PaymentLink.Status.SENT:  # paid while we were asking the gateway
            return False
        link.status = PaymentLink.Status.EXPIRED
        link._change_reason = f"unpaid after {settings.PAYMENT_LINK_EXPIRY_HOURS} hours"
        link.save(update_fields=["status"])
        record_audit(actor=ACTOR, action="payment_link.expired", subject_type="payment_link", subject_id=link.pk,
                     data={"payment_id": payment.pk, "amount_minor": link.amount_minor,
                           "processor_link_id": link.processor_link_id,
                           "expiry_hours": settings.PAYMENT_LINK_EXPIRY_HOURS})
    return True

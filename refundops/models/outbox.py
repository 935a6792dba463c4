"""The transactional outbox: every effect that must follow a commit (a task to run: a submission,
a merchant webhook delivery, the breaker's count) is a row written in the deciding transaction.
A broker that is down at commit then delays the effect, never loses it (``refundops.outbox``)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone


class OutboxMessage(models.Model):
    """One Celery task to send once its transaction has committed, and every try to send it."""

    task = models.CharField(max_length=200)  # the registered task name, e.g. refundops.tasks.submit_refund
    kwargs = models.JSONField(default=dict)
    queue = models.CharField(max_length=100, blank=True)  # empty: the task's router decides
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)
    tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    # Not before then: a sender that claimed the row holds it until then (a sender that died
    # mid-send lets go by itself); after a failed try, the relay's next sweep takes it.
    next_try_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["next_try_at"], condition=Q(sent_at__isnull=True),
                                name="outbox_unsent_next_try")]

    def __str__(self) -> str:
        return f"{self.task} {self.kwargs} {'sent' if self.sent_at else 'unsent'}"

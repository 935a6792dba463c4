from django.conf import settings
from django.db import models
from simple_history.models import HistoricalRecords

from processors.money import CURRENCY_CHOICES


class ApprovalAuthority(models.Model):
    """A named person's authority, set in advance: they may approve held refunds up to this amount."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="refund_authorities")
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    max_amount_minor = models.BigIntegerField(help_text="Largest single refund this person may approve")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    class Meta:
        verbose_name_plural = "approval authorities"
        constraints = [models.UniqueConstraint(fields=["user", "currency"], name="one_authority_per_currency")]

    def __str__(self) -> str:
        return f"{self.user} up to {self.max_amount_minor} {self.currency}"

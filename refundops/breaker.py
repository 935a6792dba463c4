"""The circuit breaker over agent refund volume. Placeholder until the policy engine lands."""

from datetime import datetime


def is_open(*, now: datetime) -> bool:
    return False

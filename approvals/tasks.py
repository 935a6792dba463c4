from celery import shared_task

from approvals import services


@shared_task
def expire_held_refunds() -> int:
    return services.expire_held_refunds()

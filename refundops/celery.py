import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")

app = Celery("refundops")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.task_prerun.connect
@signals.task_postrun.connect
def close_old_connections(sender=None, **kwargs) -> None:
    """Around each task a worker runs, what Django does around each request: close this thread's
    database connections that are broken or older than ``CONN_MAX_AGE``, and mark the others to be
    checked before their next use (``CONN_HEALTH_CHECKS``). Celery's own fixup would close every
    connection around every task whatever CONN_MAX_AGE says; ``CELERY_DB_REUSE_MAX`` leaves that to
    this. Not for a task run eagerly: that one runs inside its caller's transaction."""
    if getattr(getattr(sender, "request", None), "is_eager", False):
        return
    from django.db import close_old_connections as close

    close()

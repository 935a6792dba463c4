import os
import threading

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")

app = Celery("refundops")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_configure.connect
def load_settings_or_say_what_to_set(sender=None, **kwargs) -> None:
    """`celery -A refundops worker` (or beat) first reads Django's settings while parsing its own
    options: a configuration error there stops it with the one line manage.py and the web servers
    print, not Celery's traceback. (SystemExit passes through Celery's signal dispatch, which only
    catches Exception.)"""
    from django.conf import settings

    from refundops.startup import configuration_errors_in_one_line

    with configuration_errors_in_one_line():
        settings.INSTALLED_APPS  # noqa: B018 - reading one setting loads them all


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


@signals.task_postrun.connect
def close_pool_thread_connections(sender=None, **kwargs) -> None:
    """After a task run by a pool of threads (``--pool threads``), whose threads may end with it:
    close the thread's connections rather than leave them open behind it (an in-process test
    worker's did, until the test database could not be dropped). Prefork (the default) and solo
    run tasks in their process's main thread, which keeps its connection from task to task."""
    if getattr(getattr(sender, "request", None), "is_eager", False) or threading.current_thread() is threading.main_thread():
        return
    from django.db import connections

    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block:
            conn.close()

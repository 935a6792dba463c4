"""What a process that its configuration stops says: one line naming what to set (and the .env file
the settings read as well), never a traceback. manage.py, refundops.wsgi and refundops.asgi load
Django inside :func:`configuration_errors_in_one_line`, Celery's worker and beat in its `on_configure`
signal (refundops/celery.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

ENV_FILE = Path(__file__).resolve().parent.parent / ".env"  # refundops/settings.py reads it too
# gunicorn's exit code for a worker that cannot boot: its master stops instead of starting another.
CANNOT_START = 3


@contextmanager
def configuration_errors_in_one_line() -> Iterator[None]:
    try:
        yield
    except ImproperlyConfigured as error:
        read_too = (f" (Settings come from the environment and from {ENV_FILE}: fix it there, or move it away "
                    "for development mode.)" if ENV_FILE.exists() else "")
        print(f"RefundOps cannot start: {error}{read_too}", file=sys.stderr, flush=True)
        raise SystemExit(CANNOT_START) from None

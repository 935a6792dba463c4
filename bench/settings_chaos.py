"""The platform as deployed, for the fault harness (bench/chaos.py): every timer short, so a run of a
few minutes sees many leases run out, many retries, sweeps and syncs; the gateways are the fakes.

The harness and its worker subprocesses read the same module: they agree on the fake Stripe's
address (``CHAOS_STRIPE_API_BASE``), the private Redis (``REDIS_URL``) and the database.
"""

import os

from refundops.settings import *  # noqa: F403
from refundops.settings import CELERY_BROKER_TRANSPORT_OPTIONS, PROCESSORS

# Limits far above what the harness sends: it proves exactly-once, not refusals.
RATE_LIMIT_AGENT_PER_MINUTE = 10**7
RATE_LIMIT_SESSION_PER_MINUTE = 10**7
RATE_LIMIT_GLOBAL_PER_MINUTE = 10**8
RATE_LIMIT_WEBHOOK_PER_MINUTE = 0
BREAKER_MIN_COUNT = 10**9
BREAKER_MIN_VALUE = 10**12

# Short timers. The lease still outlasts every gateway call: the fake Stripe's client times out
# after CHAOS_GATEWAY_TIMEOUT seconds, the sandbox is a database call.
GATEWAY_TIMEOUT_SECONDS = float(os.environ.get("CHAOS_GATEWAY_TIMEOUT", "1.5"))
GATEWAY_ATTEMPT_LEASE_SECONDS = 6
CELERY_VISIBILITY_TIMEOUT_SECONDS = 20
# A SIGKILLed worker's unacknowledged tasks come back after the visibility timeout; sweep for them
# every second rather than every ~100 s, so the run sees them back within its deadline.
CELERY_BROKER_TRANSPORT_OPTIONS = {**CELERY_BROKER_TRANSPORT_OPTIONS,
                                   "visibility_timeout": CELERY_VISIBILITY_TIMEOUT_SECONDS,
                                   "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
OUTBOX_GRACE_SECONDS = 2
REFUND_SUBMIT_MAX_RETRIES = 6
REFUND_SUBMIT_BACKOFF_BASE_SECONDS = 0.5
REFUND_SUBMIT_BACKOFF_MAX_SECONDS = 2
REFUND_FIRST_SYNC_SECONDS = 3  # the webhook usually comes first
REFUND_SYNC_AFTER_SECONDS = 2
REFUND_STALLED_AFTER_SECONDS = 3
GATEWAY_BREAKER_COOLDOWN_SECONDS = 1
WEBHOOK_BACKOFF_BASE_SECONDS = 0.5
WEBHOOK_BACKOFF_MAX_SECONDS = 2
WEBHOOK_TIMEOUT_SECONDS = 3
WEBHOOK_MAX_ATTEMPTS = 30
WEBHOOK_OVERDUE_SECONDS = 4  # a delivery this overdue lost its task: sent again
RECONCILE_GRACE_SECONDS = 0
MERCHANT_WEBHOOK_ALLOW_PRIVATE = True  # the merchant's receiver is the harness, on 127.0.0.1

PROCESSORS = {
    **PROCESSORS,
    "stripe": {"default": {
        "api_key": os.environ.get("CHAOS_STRIPE_API_KEY", "sk_test_chaos"),
        "api_base": os.environ.get("CHAOS_STRIPE_API_BASE", ""),
        "webhook_secret": os.environ.get("CHAOS_STRIPE_WEBHOOK_SECRET", "whsec_chaos"),
        "timeout": GATEWAY_TIMEOUT_SECONDS,
    }},
}

LOGGING = {"version": 1, "disable_existing_loggers": False,
           "handlers": {"console": {"class": "logging.StreamHandler"}},
           "loggers": {"refundops": {"handlers": ["console"], "level": os.environ.get("CHAOS_LOG_LEVEL", "ERROR")},
                       "celery": {"handlers": ["console"], "level": "ERROR"}}}

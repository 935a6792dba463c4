"""The platform as deployed, for the merchant webhook drain benchmark (bench/webhook_drain.py): the
merchant's receiver is the benchmark itself, on 127.0.0.1."""

from bench.settings_full import *  # noqa: F403

MERCHANT_WEBHOOK_ALLOW_PRIVATE = True
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "handlers": {"console": {"class": "logging.StreamHandler"}},
           "loggers": {"refundops": {"handlers": ["console"], "level": "ERROR"},
                       "celery": {"handlers": ["console"], "level": "ERROR"}}}

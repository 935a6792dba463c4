"""The platform as deployed, for the drain benchmark (bench/drain.py): its worker subprocesses and the
process that seeds and watches them read this module. Rate limits and the breaker run with ceilings
far above what the benchmark sends (bench.settings_full); timers, pools and connections are the
deployed defaults. The sandbox gateway's settle delay is set to zero in its own control row."""

from bench.settings_full import *  # noqa: F403

LOGGING = {"version": 1, "disable_existing_loggers": False,
           "handlers": {"console": {"class": "logging.StreamHandler"}},
           "loggers": {"refundops": {"handlers": ["console"], "level": "ERROR"},
                       "celery": {"handlers": ["console"], "level": "ERROR"}}}

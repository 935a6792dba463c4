"""The platform as deployed, for the benchmark: rate limits and the breaker run on every request
but with ceilings far above what the benchmark sends (it measures speed, not refusals)."""

from refundops.settings import *  # noqa: F403

RATE_LIMIT_AGENT_PER_MINUTE = 10**7
RATE_LIMIT_SESSION_PER_MINUTE = 10**7
RATE_LIMIT_GLOBAL_PER_MINUTE = 10**8
BREAKER_MIN_COUNT = 10**9
BREAKER_MIN_VALUE = 10**12
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "loggers": {"refundops": {"level": "ERROR"}}}

"""Prometheus metrics at ``/metrics`` (prometheus-client).

Where each series comes from, so that one scrape of any web process sees the whole platform:
- this process's HTTP requests: prometheus-client counters (summed over every gunicorn worker when
  ``PROMETHEUS_MULTIPROC_DIR`` is set, as compose does);
- what the workers did (verdicts, holds, refunds by state and gateway, held refunds' age, webhook
  lag, the kill switch): read from the database at scrape time, the one place every process writes;
- gateway latency and errors, measured around every gateway call in the worker: counted in Redis
  (:func:`record_gateway_call`), as are the queues and breakers, and read from there.

Access: ``Authorization: Bearer $METRICS_TOKEN``; with no token set, only from loopback and only in
development mode.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import time
from collections import Counter as Tally
from pathlib import Path

import redis
from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.db.models import Count, Min
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily
from redis.commands.core import Script

from processors import breaker as gateway_breaker
from processors.redis_client import redis_client, redis_key

log = logging.getLogger(__name__)

GATEWAY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GATEWAY_OUTCOMES = ("ok", "declined", "unavailable")
LOOPBACK = {"127.0.0.1", "::1"}

# A request's method is the client's text: any other is counted as "other", so no client can add series.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
HTTP_REQUESTS = Counter("refundops_http_requests", "HTTP requests answered, by route and status",
                        ["method", "route", "status"])
HTTP_SECONDS = Histogram("refundops_http_request_seconds", "Time to answer an HTTP request", ["method", "route"])


class RequestMetricsMiddleware:
    """Counts and times every request by its URL name (never the raw path: ids would explode it).
    Sync and async capable: under ASGI it costs the request no loop-to-thread crossing."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self.__acall__(request)
        started = time.perf_counter()
        return self._count(request, self.get_response(request), started)

    async def __acall__(self, request):
        started = time.perf_counter()
        return self._count(request, await self.get_response(request), started)

    @staticmethod
    def _count(request, response, started: float):
        match = getattr(request, "resolver_match", None)
        route = (match.url_name or match.route) if match else "unmatched"
        method = request.method if request.method in HTTP_METHODS else "other"
        HTTP_REQUESTS.labels(method, route, str(response.status_code)).inc()
        HTTP_SECONDS.labels(method, route).observe(time.perf_counter() - started)
        return response


def _gateway_key(gateway: str) -> str:
    return redis_key(f"metrics:gateway:{gateway}")


def record_gateway_call(gateway: str, outcome: str, seconds: float) -> None:
    """One gateway call, kept in Redis so that the web process's /metrics sees the workers' calls.
    Best effort: a metric is never a reason to fail a payout."""
    try:
        _count_call_script(redis_client())(keys=[_gateway_key(gateway)], args=[outcome, repr(seconds)])
    except redis.RedisError:
        log.warning("metrics: Redis unreachable; gateway call to %s not counted", gateway)


# One call counts it: the count, the sum, and each bucket the call fits in (cumulative, as Prometheus
# reads them). Eleven HINCRBYs in a pipeline cost the worker's settle ~0.7 ms of redis-py's packing.
_COUNT_CALL_LUA = """
local outcome, seconds = ARGV[1], tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[1], outcome .. ':count', 1)
for _, bucket in ipairs({%s}) do
  if seconds <= tonumber(bucket) then redis.call('HINCRBY', KEYS[1], outcome .. ':le:' .. bucket, 1) end
end
redis.call('HINCRBYFLOAT', KEYS[1], outcome .. ':sum', ARGV[2])
""" % ", ".join(f"'{b}'" for b in GATEWAY_BUCKETS)


@functools.cache
def _count_call_script(client: redis.Redis) -> Script:
    """One per client: redis-py sends EVALSHA, and loads the script again after NOSCRIPT."""
    return client.register_script(_COUNT_CALL_LUA)


def _queue_depth(queue: str) -> int:
    if settings.CELERY_BROKER_URL.startswith("redis"):
        # kombu's Redis transport: one list per queue (and per priority step), under the key prefix.
        prefix = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("global_keyprefix", "")
        names = [f"{prefix}{queue}", *(f"{prefix}{queue}\x06\x16{p}" for p in (3, 6, 9))]
        pipe = redis_client().pipeline(transaction=False)
        for name in names:
            pipe.llen(name)
        return sum(pipe.execute())
    folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"])
    return sum(1 for f in folder.glob(f"*.{queue}.msg")) if folder.is_dir() else 0


class PlatformCollector:
    """Series read at scrape time from the database and Redis, which every process writes."""

    def collect(self):
        from audit.models import Verdict
        from refundops import breaker as agent_breaker
        from refundops.models import OutboxMessage, PlatformState, Refund, RefundState, WebhookDelivery

        now = timezone.now()
        verdicts = CounterMetricFamily("refundops_verdicts", "Verdicts given, by outcome and contract code",
                                       labels=["outcome", "code"])
        for row in Verdict.objects.values("outcome", "code").annotate(n=Count("id")).order_by():
            verdicts.add_metric([row["outcome"], row["code"]], row["n"])
        yield verdicts

        reasons = Tally()
        for hold_reasons in Refund.objects.exclude(hold_reasons=[]).values_list("hold_reasons", flat=True).iterator():
            reasons.update(hold_reasons or [])
        holds = CounterMetricFamily("refundops_holds", "Refunds held for a person, by hold reason", labels=["reason"])
        for reason, n in sorted(reasons.items()):
            holds.add_metric([reason], n)
        yield holds

        refunds = GaugeMetricFamily("refundops_refunds", "Refunds by state and gateway (settled and failed "
                                    "only grow)", labels=["status", "gateway"])
        for row in Refund.objects.values("status", "payment__processor").annotate(n=Count("id")).order_by():
            refunds.add_metric([row["status"], row["payment__processor"]], row["n"])
        yield refunds

        oldest = Refund.objects.filter(status=RefundState.HELD).aggregate(at=Min("created_at"))["at"]
        yield GaugeMetricFamily("refundops_oldest_held_refund_age_seconds", "Age of the oldest refund waiting "
                                "for approval (0: none)", value=(now - oldest).total_seconds() if oldest else 0)

        waiting = WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING)
        first = waiting.aggregate(at=Min("created_at"))["at"]
        yield GaugeMetricFamily("refundops_webhook_delivery_lag_seconds", "Age of the oldest webhook not yet "
                                "delivered to a merchant (0: none)", value=(now - first).total_seconds() if first else 0)
        deliveries = GaugeMetricFamily("refundops_webhook_deliveries", "Webhook deliveries by status",
                                       labels=["status"])
        for row in WebhookDelivery.objects.values("status").annotate(n=Count("id")).order_by():
            deliveries.add_metric([row["status"]], row["n"])
        yield deliveries

        unsent = OutboxMessage.objects.filter(sent_at__isnull=True).aggregate(n=Count("id"), at=Min("created_at"))
        yield GaugeMetricFamily("refundops_outbox_unsent", "Effects committed but not yet handed to the broker "
                                "(grows while the broker is away)", value=unsent["n"])
        yield GaugeMetricFamily("refundops_outbox_oldest_unsent_age_seconds", "Age of the oldest effect not yet "
                                "handed to the broker (0: none)",
                                value=(now - unsent["at"]).total_seconds() if unsent["at"] else 0)

        state = PlatformState.current()
        yield GaugeMetricFamily("refundops_refunds_paused", "Kill switch: agent refunds paused",
                                value=int(state.refunds_paused))
        yield GaugeMetricFamily("refundops_agents_disabled", "Kill switch: all agent access off",
                                value=int(state.agents_disabled))
        yield from self._from_redis(agent_breaker, now)

    def _from_redis(self, agent_breaker, now):
        up = GaugeMetricFamily("refundops_metrics_source_up", "1 when the source of some series answered",
                               labels=["source"])
        up.add_metric(["database"], 1)
        try:
            families = list(self._redis_families(agent_breaker, now))
        except Exception as error:  # Redis away: say so, still serve the database's series
            log.warning("metrics: Redis unreachable (%s)", error)
            families = []
        up.add_metric(["redis"], 1 if families else 0)
        yield up
        yield from families

    @staticmethod
    def _redis_families(agent_breaker, now):
        redis_client().ping()
        gateways = sorted(settings.PROCESSORS)
        latency = HistogramMetricFamily("refundops_gateway_request_seconds", "Gateway call time, by outcome",
                                        labels=["gateway", "outcome"])
        errors = CounterMetricFamily("refundops_gateway_errors", "Gateway calls that failed, by kind",
                                     labels=["gateway", "kind"])
        for gateway in gateways:
            raw = {k.decode(): float(v) for k, v in redis_client().hgetall(_gateway_key(gateway)).items()}
            for outcome in GATEWAY_OUTCOMES:
                count = raw.get(f"{outcome}:count", 0)
                buckets = [(str(b), raw.get(f"{outcome}:le:{b}", 0)) for b in GATEWAY_BUCKETS] + [("+Inf", count)]
                latency.add_metric([gateway, outcome], buckets, raw.get(f"{outcome}:sum", 0))
                if outcome != "ok":
                    errors.add_metric([gateway, outcome], count)
        yield latency
        yield errors

        breakers = GaugeMetricFamily("refundops_gateway_breaker_open", "1 while a gateway's breaker stops calls "
                                     "(open or half-open)", labels=["gateway", "account"])
        for gateway in gateways:
            for account in sorted(settings.PROCESSORS[gateway]):
                current = gateway_breaker.state(gateway, account)
                breakers.add_metric([gateway, account], 0 if current.phase == "closed" else 1)
        yield breakers
        yield GaugeMetricFamily("refundops_agent_breaker_open", "1 while the refund-volume breaker refuses "
                                "agent refunds", value=int(agent_breaker.status(now=now) == "open"))

        depth = GaugeMetricFamily("refundops_queue_depth", "Tasks waiting in each Celery queue", labels=["queue"])
        for queue in settings.CELERY_WORKER_QUEUES:
            depth.add_metric([queue], _queue_depth(queue))
        yield depth


class _ThisProcess:
    """The request counters: this process's, or every web worker's in multiprocess mode."""

    def collect(self):
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            yield from registry.collect()
        else:
            yield from REGISTRY.collect()


def _allowed(request) -> bool:
    token = getattr(settings, "METRICS_TOKEN", "")
    if token:
        sent = request.headers.get("Authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())
    return not settings.PRODUCTION and request.META.get("REMOTE_ADDR") in LOOPBACK


@never_cache
def metrics_view(request):
    if not _allowed(request):
        return HttpResponse("Send 'Authorization: Bearer <METRICS_TOKEN>'. Without METRICS_TOKEN set, /metrics "
                            "answers only loopback in development mode.\n", status=401,
                            content_type="text/plain", headers={"WWW-Authenticate": "Bearer"})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ThisProcess())
    registry.register(PlatformCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

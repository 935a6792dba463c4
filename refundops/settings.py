"""Settings from the environment (django-environ). Every secret and address is an env variable.

With no DATABASE_URL the platform runs on SQLite in ./var; with no REDIS_URL the Celery broker is
kombu's filesystem transport in ./var and rate-limit and breaker state lives in an in-process
fakeredis. That embedded mode is for trying the product on one machine; production and the test
suite set both URLs (PostgreSQL and Redis).
"""

import sys
from datetime import timedelta
from pathlib import Path

import environ
from kombu import Exchange, Queue
from django.core.checks.security.base import (
    SECRET_KEY_INSECURE_PREFIX,
    SECRET_KEY_MIN_LENGTH,
    SECRET_KEY_MIN_UNIQUE_CHARACTERS,
)
from django.core.exceptions import ImproperlyConfigured

from refundops import logs

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)
# Where embedded mode keeps its SQLite file and broker folders, and scripts/run its logs.
VAR_DIR = Path(env("REFUNDOPS_VAR_DIR", default=str(BASE_DIR / "var")))

# Production mode: no published secret, no sandbox unless asked for with a secret of its own, no
# demo data. Unset, the platform runs in development mode (scripts/run).
PRODUCTION = env("REFUNDOPS_ENV", default="development") == "production"
DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me"
# Keys that were ever written in this repository (compose once defaulted to the second).
PUBLISHED_SECRET_KEYS = (DEV_SECRET_KEY, "change-me-in-production")


def _weak_secret_key(key: str) -> bool:
    """Short, of few distinct characters (``'ab' * 25``), generated for development
    (``django-insecure-``), or published here: Django's deploy check's rule (security.W009), plus ours."""
    return (len(key) < SECRET_KEY_MIN_LENGTH or len(set(key)) < SECRET_KEY_MIN_UNIQUE_CHARACTERS
            or key.startswith(SECRET_KEY_INSECURE_PREFIX) or key in PUBLISHED_SECRET_KEYS)


if PRODUCTION and _weak_secret_key(env("DJANGO_SECRET_KEY", default="")):
    raise ImproperlyConfigured(
        "REFUNDOPS_ENV=production needs DJANGO_SECRET_KEY: a long random value of your own (50 characters or "
        "more, e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))'), never a published one.")
# A fallback still verifies sessions and signed values (a forged admin session signed with the
# published key would pass): held to the same rule. The message names the position, never the key.
_weak_fallbacks = [str(n) for n, key in enumerate(env.list("DJANGO_SECRET_KEY_FALLBACKS", default=[]), 1)
                   if _weak_secret_key(key)]
if PRODUCTION and _weak_fallbacks:
    raise ImproperlyConfigured(
        f"REFUNDOPS_ENV=production refuses DJANGO_SECRET_KEY_FALLBACKS entry {', '.join(_weak_fallbacks)} (counting "
        "from 1): each must be a long random key that was yours (50+ characters, 5+ distinct), never a published "
        "one; drop it from the list.")

DEBUG = env.bool("DJANGO_DEBUG", default=False)
SECRET_KEY = env("DJANGO_SECRET_KEY", default=DEV_SECRET_KEY)
# The previous key(s) while rotating: sessions and signed values made with them stay valid.
SECRET_KEY_FALLBACKS = env.list("DJANGO_SECRET_KEY_FALLBACKS", default=[])
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "roles.apps.StaffAdminConfig",  # django.contrib.admin, signing in with a second factor
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's assets served by us: no CDN at run time
    "simple_history",
    "axes",
    "django_otp",
    "roles.apps.TOTPDevicesConfig",  # django_otp.plugins.otp_totp, with a readable heading
    "processors",
    "audit",
    "refundops.apps.RefundOpsConfig",
    "approvals",
    "proposals",
    "roles",
]

MIDDLEWARE = [
    "refundops.logs.RequestIdMiddleware",  # first: every line a request logs carries its id
    "refundops.metrics.RequestMetricsMiddleware",  # first: counts every answer, refusals included
    "refundops.middleware.BodyLimitMiddleware",  # before anything reads a body (WSGI; ASGI: asgi_handler)
    "refundops.middleware.RefuseNulMiddleware",  # before any query sees a path, filter or form value
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # the admin's static files (not under refundops.asgi: below)
    # refundops.middleware: Django's, django-otp's and simple_history's, passed by for /api/ (key only)
    "refundops.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "refundops.middleware.AuthenticationMiddleware",
    "refundops.middleware.OTPMiddleware",
    "refundops.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "refundops.middleware.HistoryRequestMiddleware",
    "axes.middleware.AxesMiddleware",  # last: answers a locked-out sign-in
]
if "refundops.asgi" in sys.modules and not DEBUG:
    # Served by refundops.asgi (uvicorn, gunicorn's UvicornWorker): it serves STATIC_ROOT at
    # STATIC_URL itself, on the event loop, and a static file never takes one of the threads
    # Django's requests wait for (refundops/asgi_handler.py). (With DEBUG, WhiteNoise stays: it
    # finds static files before any collectstatic.)
    MIDDLEWARE.remove("whitenoise.middleware.WhiteNoiseMiddleware")

ROOT_URLCONF = "refundops.urls"
WSGI_APPLICATION = "refundops.wsgi.application"
ASGI_APPLICATION = "refundops.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'refundops.sqlite3'}")}
DATABASES["default"]["ATOMIC_REQUESTS"] = False
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update({"timeout": 20, "transaction_mode": "IMMEDIATE"})
elif env.bool("DATABASE_POOL", default="refundops.asgi" in sys.modules or sys.argv[1:2] == ["mcp"]):
    # Under ASGI (refundops.asgi: uvicorn, gunicorn's UvicornWorker) each MCP call, over HTTP and
    # in `manage.py mcp` (stdio), runs in a thread of its own that ends with it, so a persistent
    # connection would be left behind with its thread: Django's docs say to pool instead. (Django's
    # own requests there run on the WEB_THREADS threads each process keeps, and check a connection
    # out of the same pool per request: no statement, no round trip.) So these processes have a
    # psycopg pool unless DATABASE_POOL says otherwise.
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": env.int("DATABASE_POOL_MIN", default=2), "max_size": env.int("DATABASE_POOL_MAX", default=20)}
else:
    # Everywhere else (WSGI workers, Celery workers and beat, commands, tests) each thread keeps
    # its connection for this long, checked before it is used again after a request or task (a
    # PostgreSQL restart costs one reconnect, not an error). Never a connection per request.
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("DATABASE_CONN_MAX_AGE", default=600)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# What stands between the app and PostgreSQL: "none" (it connects straight to PostgreSQL),
# "pgbouncer-session", "pgbouncer-transaction"; unset, it is not known, and nothing is counted on that
# a pooler could break. A prepared statement lives in one server session: PgBouncer in transaction
# mode hands a client's transactions to whichever server session is free, and keeps protocol-level
# prepares only from 1.21 (max_prepared_statements; Debian 12 ships 1.18), SQL-level ones never.
DATABASE_POOLER = env.str("DATABASE_POOLER", default="")
_POOLERS = ("", "none", "pgbouncer-session", "pgbouncer-transaction")
if DATABASE_POOLER not in _POOLERS:
    raise ImproperlyConfigured(f"DATABASE_POOLER={DATABASE_POOLER!r} is not one of {', '.join(filter(None, _POOLERS))}.")
# Statements psycopg prepares on each connection (server-side binding: one it has run
# DATABASE_PREPARE_THRESHOLD times is parsed once a session and, soon, no longer planned), at most
# this many (least recently used deallocated); 0 prepares none. On by default only where the pooler
# is known to keep a session's statements.
DATABASE_PREPARED_STATEMENTS = env.int(
    "DATABASE_PREPARED_STATEMENTS", default=100 if DATABASE_POOLER in ("none", "pgbouncer-session") else 0)
DATABASE_PREPARE_THRESHOLD = env.int("DATABASE_PREPARE_THRESHOLD", default=5)  # psycopg's default
if DATABASE_POOLER == "pgbouncer-transaction" and DATABASE_PREPARED_STATEMENTS:
    raise ImproperlyConfigured(
        f"DATABASE_PREPARED_STATEMENTS={DATABASE_PREPARED_STATEMENTS} cannot work behind DATABASE_POOLER=pgbouncer-transaction "
        "(a prepared statement stays on one server session, PgBouncer moves the next transaction to another): "
        "set DATABASE_PREPARED_STATEMENTS=0.")
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # psycopg binds parameters on the server (its own prepared statements and pipeline mode need it;
    # refundops.batching); prepare_threshold is set per connection from the two settings above.
    DATABASES["default"].setdefault("OPTIONS", {})["server_side_binding"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis holds only what may be rebuilt: rate-limit windows, breaker state, the broker's queue.
REDIS_URL = env("REDIS_URL", default="")
# Every key this install writes (ours and the broker's queues) starts with this prefix, so two
# installs, or two test runs, can share one Redis without seeing each other's state or tasks.
REDIS_KEY_PREFIX = env("REDIS_KEY_PREFIX", default="")
# A task a worker took but did not acknowledge (acks_late) goes back to the queue after this long;
# every countdown and ETA we set stays below it, or the broker would hand out a second copy.
CELERY_VISIBILITY_TIMEOUT_SECONDS = env.int("CELERY_VISIBILITY_TIMEOUT_SECONDS", default=3600)
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    # A broker that does not answer (no refusal, silence) costs a request at most this long per
    # outbox nudge, not the system's TCP timeout of minutes: the outbox keeps the effect anyway.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": REDIS_KEY_PREFIX,
                                       "visibility_timeout": CELERY_VISIBILITY_TIMEOUT_SECONDS,
                                       "socket_connect_timeout": 2}
else:
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(VAR_DIR / "broker"),
        "data_folder_out": str(VAR_DIR / "broker"),
        "processed_folder": str(VAR_DIR / "broker-processed"),
        "control_folder": str(VAR_DIR / "broker-control"),  # exchange bindings (else ./control)
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # a worker that dies mid-task leaves the task to be run again
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_TASK_ROUTES = ("refundops.tasks.route_payment_task",)
# What a worker serving every queue consumes; run one worker per gateway queue to isolate them.
CELERY_WORKER_QUEUES = ["default", "payments.sandbox", "payments.stripe", "payments.paypal"]
# Declared, so a plain `celery -A refundops worker` consumes every one of them; `-Q payments.stripe`
# still narrows a worker to one gateway.
CELERY_TASK_QUEUES = [Queue(name, Exchange(name), routing_key=name) for name in CELERY_WORKER_QUEUES]
CELERY_TASK_DEFAULT_QUEUE = "default"
# Tasks a worker runs at once (the CPU count when unset); each holds one database connection, kept
# between tasks as CONN_MAX_AGE says (below), so the web's pool is not used in workers.
CELERY_WORKER_CONCURRENCY = env.int("CELERY_WORKER_CONCURRENCY", default=None)
# Celery's Django fixup closes every database connection before and after each task, whatever
# CONN_MAX_AGE says, unless this is set (then it closes them every this many tasks). It is set, and
# refundops/celery.py closes connections around each task as Django does around a request: in a
# worker as on the web, CONN_MAX_AGE and CONN_HEALTH_CHECKS decide how long one is kept.
CELERY_DB_REUSE_MAX = 1000
# The transactional outbox (refundops/outbox.py): a row unsent this long after its commit (the
# broker was down, or the process died) is sent by beat's relay, which runs this often.
OUTBOX_GRACE_SECONDS = env.int("OUTBOX_GRACE_SECONDS", default=10)
OUTBOX_SWEEP_SECONDS = env.int("OUTBOX_SWEEP_SECONDS", default=15)
OUTBOX_KEEP_SENT_DAYS = env.int("OUTBOX_KEEP_SENT_DAYS", default=7)  # then the relay deletes sent rows
CELERY_BEAT_SCHEDULE = {
    "relay-outbox": {"task": "refundops.tasks.relay_outbox", "schedule": timedelta(seconds=OUTBOX_SWEEP_SECONDS)},
    # Each decision reads the day's buckets and the rows written since the last fold.
    "fold-refund-totals": {"task": "refundops.tasks.fold_refund_totals", "schedule": timedelta(seconds=5)},
    "drop-old-refund-totals": {"task": "refundops.tasks.drop_old_refund_totals", "schedule": timedelta(hours=1)},
    "deliver-overdue-webhooks": {"task": "refundops.tasks.deliver_overdue_webhooks", "schedule": timedelta(minutes=1)},
    "sync-submitted-refunds": {"task": "refundops.tasks.sync_submitted_refunds",
                               "schedule": timedelta(seconds=env.int("SYNC_INTERVAL_SECONDS", default=30))},
    "resubmit-stalled-approved-refunds": {"task": "refundops.tasks.resubmit_stalled_refunds",
                                          "schedule": timedelta(minutes=1)},
    "resolve-stalled-operations": {"task": "refundops.tasks.resolve_stalled_operations",
                                   "schedule": timedelta(minutes=1)},
    "expire-held-refunds": {"task": "approvals.tasks.expire_held_refunds",
                            "schedule": timedelta(minutes=15)},
    "expire-payment-links": {"task": "refundops.tasks.expire_payment_links",
                             "schedule": timedelta(minutes=15)},
    "seal-audit-log": {"task": "audit.tasks.seal_audit_log",
                       "schedule": timedelta(seconds=env.int("AUDIT_SEAL_INTERVAL_SECONDS", default=2))},
    "reconcile-ledgers": {"task": "refundops.tasks.reconcile_ledgers",
                          "schedule": timedelta(seconds=env.int("RECONCILE_INTERVAL_SECONDS", default=3600))},
}
# The revocation drill (manage.py revocation_drill) on a schedule: off unless given a number of hours.
REVOCATION_DRILL_INTERVAL_HOURS = env.int("REVOCATION_DRILL_INTERVAL_HOURS", default=0)
if REVOCATION_DRILL_INTERVAL_HOURS > 0:
    CELERY_BEAT_SCHEDULE["revocation-drill"] = {"task": "audit.tasks.run_revocation_drill",
                                                "schedule": timedelta(hours=REVOCATION_DRILL_INTERVAL_HOURS)}
# The reconciler leaves a refund touched this recently to the worker and the sync (still on its way).
RECONCILE_GRACE_SECONDS = env.int("RECONCILE_GRACE_SECONDS", default=600)

# The audit chain (audit/chain.py) is keyed with AUDIT_KEY, which never enters the database: keep
# it in the environment of the web, worker and beat processes and of whoever runs verify_audit.
AUDIT_KEY = env("AUDIT_KEY", default="")
if env("REFUNDOPS_ENV", default="") == "production" and len(AUDIT_KEY) < 32:
    raise ImproperlyConfigured("Production mode needs AUDIT_KEY (at least 32 random characters) to key the "
                               "audit chain; keep it outside the database.")
AUDIT_KEY = AUDIT_KEY or "dev-only-audit-key-not-secret"

# The auditors' evidence pack (audit/evidence.py) is signed with an Ed25519 private key kept in this
# file (PEM), never in the repository: `evidence_pack --new-key` writes one; the auditor keeps its
# public half. No default: a published key would let anyone sign a pack.
EVIDENCE_SIGNING_KEY = env("EVIDENCE_SIGNING_KEY", default="")

# Embedded mode (SQLite, a filesystem broker, per-process rate limits) is for one machine trying the
# product: production mode refuses it, so an image started without its environment says so.
_missing_services = [name for name in ("DATABASE_URL", "REDIS_URL") if not env(name, default="")]
if PRODUCTION and _missing_services:
    raise ImproperlyConfigured(
        f"REFUNDOPS_ENV=production needs {' and '.join(_missing_services)} (PostgreSQL and Redis); embedded mode "
        "(SQLite and a filesystem broker) is for development only. docker-compose.yml sets both.")
AUDIT_SEAL_GRACE_SECONDS = env.int("AUDIT_SEAL_GRACE_SECONDS", default=300)  # verify_audit fails past this

# DJANGO_SECURE=true behind TLS: secure cookies, HSTS, HTTPS only, and the proxy's word for it.
if env.bool("DJANGO_SECURE", default=False):
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env.int("DJANGO_HSTS_SECONDS", default=31_536_000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = env.bool("DJANGO_HSTS_PRELOAD", default=True)
    # Probes inside the deployment's network speak plain HTTP to the process itself.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]

# Admin sign-in: N wrong passwords (or codes) lock the username for a while, whoever tries (so
# rotating addresses does not help), and the address, whatever names it tries; a second factor
# (roles.signin) where needed.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("AXES_COOLOFF_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_RESET_ON_SUCCESS = True
AXES_ENABLE_ADMIN = False  # unlock with manage.py axes_reset_username USER
OTP_TOTP_ISSUER = "RefundOps"
OTP_ADMIN_HIDE_SENSITIVE_DATA = True  # nobody reads another person's TOTP key in the admin

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env("TIME_ZONE", default="UTC")  # the day that daily limits count in
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = env("STATIC_ROOT", default=str(VAR_DIR / "static"))
Path(STATIC_ROOT).mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every start without it

# One JSON object per line on stderr (structlog), secrets redacted, each with the request id that
# follows a refund from the call to the worker, the gateway and the webhooks (refundops/logs.py).
LOG_LEVEL = env("LOG_LEVEL", default="INFO")
LOG_FORMAT = env("LOG_FORMAT", default="json")  # or "console", for a person at a terminal
logs.configure_structlog()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"structured": logs.formatter(LOG_FORMAT)},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "structured"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        # Our loggers' level; their lines reach the root's one handler (and pytest's caplog).
        **{name: {"level": LOG_LEVEL}
           for name in ("refundops", "processors", "approvals", "audit", "proposals", "roles", "celery")},
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False  # the worker logs through LOGGING above, as JSON

EMAIL_BACKEND = env("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
OPERATOR_EMAILS = env.list("OPERATOR_EMAILS", default=[])
DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", default="refundops@localhost")
SERVER_EMAIL = env("SERVER_EMAIL", default=DEFAULT_FROM_EMAIL)
# SMTP, for EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend (breaker mail to OPERATOR_EMAILS).
EMAIL_HOST = env("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
EMAIL_USE_SSL = env.bool("EMAIL_USE_SSL", default=False)
EMAIL_TIMEOUT = env.int("EMAIL_TIMEOUT", default=10)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["refundops.api.auth.AgentKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["refundops.api.auth.HasCapability"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "refundops.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "RefundOps agent API",
    "DESCRIPTION": "Refunds, lookups, voids, captures, payment links and dispute drafts for AI agents, "
                   "each decided against finance's limits and fraud's hold rules. Amounts are integer "
                   "minor units with an ISO 4217 currency.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "COMPONENT_SPLIT_REQUEST": True,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {"OutcomeEnum": ["approved", "held", "denied"]},
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "refundops.api.schema.strict_requests"],
}

# The sandbox gateway (and its webhook route and payment page): on in development; in production
# only with SANDBOX_ENABLED=true and a SANDBOX_WEBHOOK_SECRET of its own, never the published one.
DEV_SANDBOX_WEBHOOK_SECRET = "whsec_sandbox_dev"
SANDBOX_ENABLED = env.bool("SANDBOX_ENABLED", default=not PRODUCTION)
SANDBOX_WEBHOOK_SECRET = env("SANDBOX_WEBHOOK_SECRET", default="" if PRODUCTION else DEV_SANDBOX_WEBHOOK_SECRET)
if PRODUCTION and SANDBOX_ENABLED and SANDBOX_WEBHOOK_SECRET in ("", DEV_SANDBOX_WEBHOOK_SECRET):
    raise ImproperlyConfigured("SANDBOX_ENABLED=true in production needs a SANDBOX_WEBHOOK_SECRET of its own.")

# Gateways: a refund always goes to the gateway and account that took the payment.
PROCESSORS = {
    **({"sandbox": {"default": {"webhook_secret": SANDBOX_WEBHOOK_SECRET}}} if SANDBOX_ENABLED else {}),
    "stripe": {"default": {
        "api_key": env("STRIPE_API_KEY", default=""),
        "api_base": env("STRIPE_API_BASE", default=""),
        "webhook_secret": env("STRIPE_WEBHOOK_SECRET", default=""),
    }},
    "paypal": {"default": {
        "client_id": env("PAYPAL_CLIENT_ID", default=""),
        "client_secret": env("PAYPAL_CLIENT_SECRET", default=""),
        "environment": env("PAYPAL_ENVIRONMENT", default="sandbox"),
        "base_url": env("PAYPAL_BASE_URL", default=""),
        "webhook_id": env("PAYPAL_WEBHOOK_ID", default=""),
    }},
}

# /metrics answers "Authorization: Bearer $METRICS_TOKEN"; unset, only loopback in development mode.
METRICS_TOKEN = env("METRICS_TOKEN", default="")

# Where customers open sandbox payment links (the sandbox's hosted page is served by this app).
PUBLIC_BASE_URL = env("PUBLIC_BASE_URL", default="http://127.0.0.1:8000").rstrip("/")

# Rate limits (Redis, sliding one-minute window) and the breaker over agent refund volume.
RATE_LIMIT_AGENT_PER_MINUTE = env.int("RATE_LIMIT_AGENT_PER_MINUTE", default=600)
RATE_LIMIT_SESSION_PER_MINUTE = env.int("RATE_LIMIT_SESSION_PER_MINUTE", default=300)
RATE_LIMIT_GLOBAL_PER_MINUTE = env.int("RATE_LIMIT_GLOBAL_PER_MINUTE", default=6000)
RATE_LIMIT_WINDOW_SECONDS = env.int("RATE_LIMIT_WINDOW_SECONDS", default=60)
BREAKER_WINDOW_MINUTES = env.int("BREAKER_WINDOW_MINUTES", default=5)
BREAKER_BASELINE_MINUTES = env.int("BREAKER_BASELINE_MINUTES", default=60)
BREAKER_FACTOR = env.float("BREAKER_FACTOR", default=5.0)  # trips above 5x the trailing hour's rate
BREAKER_MIN_COUNT = env.int("BREAKER_MIN_COUNT", default=100)
BREAKER_MIN_VALUE = env.int("BREAKER_MIN_VALUE", default=10_000)  # major units of each currency
BREAKER_COOLDOWN_SECONDS = env.int("BREAKER_COOLDOWN_SECONDS", default=600)
BREAKER_HALF_OPEN_PROBES = env.int("BREAKER_HALF_OPEN_PROBES", default=5)

# Gateway health and our own webhooks (defaults suit production; tests shorten them).
REFUND_SYNC_AFTER_SECONDS = env.int("REFUND_SYNC_AFTER_SECONDS", default=120)
# How long a gateway may keep a refund pending before it is overdue: reconcile then raises it
# (``submitted_overdue``) for a person. Stripe's card refunds settle within days, its slowest
# methods within about a week; PayPal's within a few days (eCheck-funded); the sandbox at once.
REFUND_SETTLEMENT_SECONDS = {"stripe": 10 * 86400, "paypal": 7 * 86400, "sandbox": 86400}
# How long after its first use a gateway still answers a repeated idempotency key with its first
# answer, less a margin: past it the same key is a new refund. Stripe removes keys after 24 h,
# PayPal keeps a refund's PayPal-Request-Id 45 days. A gateway not named here: never resent.
GATEWAY_IDEMPOTENCY_KEPT_SECONDS = {"stripe": 23 * 3600, "paypal": 44 * 86400, "sandbox": 23 * 3600}
GATEWAY_BREAKER_THRESHOLD = env.int("GATEWAY_BREAKER_THRESHOLD", default=5)
GATEWAY_BREAKER_COOLDOWN_SECONDS = env.float("GATEWAY_BREAKER_COOLDOWN_SECONDS", default=30)
# No request body over this is read, from anyone (413 PAYLOAD_TOO_LARGE; refundops.middleware): it
# must exceed every route's own cap (the API's and MCP's 64 KiB, WEBHOOK_MAX_BODY_BYTES).
REQUEST_MAX_BODY_BYTES = env.int("REQUEST_MAX_BODY_BYTES", default=1024 * 1024)
# Inbound gateway events: a body over this is refused (413) before it is parsed or verified.
WEBHOOK_MAX_BODY_BYTES = env.int("WEBHOOK_MAX_BODY_BYTES", default=512 * 1024)
# Deliveries per client address and gateway per RATE_LIMIT_WINDOW_SECONDS (0: off). REMOTE_ADDR:
# behind a proxy that rewrites it, every gateway shares the proxy's budget.
RATE_LIMIT_WEBHOOK_PER_MINUTE = env.int("RATE_LIMIT_WEBHOOK_PER_MINUTE", default=600)
# Merchant endpoints may resolve only to public addresses (refundops.merchant_http); true lets a
# receiver on this machine or network in, for development and tests. Never in production.
MERCHANT_WEBHOOK_ALLOW_PRIVATE = env.bool("MERCHANT_WEBHOOK_ALLOW_PRIVATE", default=False)
if PRODUCTION and MERCHANT_WEBHOOK_ALLOW_PRIVATE:
    raise ImproperlyConfigured("MERCHANT_WEBHOOK_ALLOW_PRIVATE=true would let merchant URLs reach inside the network.")
WEBHOOK_MAX_ATTEMPTS = env.int("WEBHOOK_MAX_ATTEMPTS", default=10)
WEBHOOK_BACKOFF_BASE_SECONDS = env.int("WEBHOOK_BACKOFF_BASE_SECONDS", default=10)
WEBHOOK_BACKOFF_MAX_SECONDS = env.int("WEBHOOK_BACKOFF_MAX_SECONDS", default=21600)
WEBHOOK_TIMEOUT_SECONDS = env.int("WEBHOOK_TIMEOUT_SECONDS", default=10)
# A pending delivery this long past its next attempt lost its task: beat sends it again.
WEBHOOK_OVERDUE_SECONDS = env.int("WEBHOOK_OVERDUE_SECONDS", default=300)

# Payment worker retries when a gateway is down: exponential backoff with jitter, capped.
REFUND_SUBMIT_MAX_RETRIES = env.int("REFUND_SUBMIT_MAX_RETRIES", default=12)
REFUND_SUBMIT_BACKOFF_BASE_SECONDS = env.int("REFUND_SUBMIT_BACKOFF_BASE_SECONDS", default=5)
REFUND_SUBMIT_BACKOFF_MAX_SECONDS = env.int("REFUND_SUBMIT_BACKOFF_MAX_SECONDS", default=1800)
REFUND_FIRST_SYNC_SECONDS = env.int("REFUND_FIRST_SYNC_SECONDS", default=6)
# How long one worker holds a refund's gateway call before its answer counts as unknown (then the
# gateway is asked). Longer than any gateway client's timeout (30 s), shorter than the broker's
# visibility timeout; an approved refund nothing touched for REFUND_STALLED_AFTER_SECONDS is swept.
GATEWAY_ATTEMPT_LEASE_SECONDS = env.int("GATEWAY_ATTEMPT_LEASE_SECONDS", default=120)
REFUND_STALLED_AFTER_SECONDS = env.int("REFUND_STALLED_AFTER_SECONDS", default=300)
if not 30 < GATEWAY_ATTEMPT_LEASE_SECONDS < CELERY_VISIBILITY_TIMEOUT_SECONDS:
    raise ImproperlyConfigured("GATEWAY_ATTEMPT_LEASE_SECONDS must outlast a gateway call (30 s) and stay "
                               "below CELERY_VISIBILITY_TIMEOUT_SECONDS")
# Business days a refund takes to reach the customer, by payment method.
REFUND_ARRIVAL_DAYS = {"card": 7, "paypal": 3, "bank_transfer": 5, "wallet": 3}
HELD_REFUND_EXPIRY_HOURS = env.int("HELD_REFUND_EXPIRY_HOURS", default=72)
# Admin lists the planner expects to be longer than this show its estimate of the count (EXPLAIN)
# rather than counting every row on every page; shorter ones are counted exactly.
ADMIN_ESTIMATED_COUNT_ABOVE = env.int("ADMIN_ESTIMATED_COUNT_ABOVE", default=10_000)
PAYMENT_LINK_EXPIRY_HOURS = env.int("PAYMENT_LINK_EXPIRY_HOURS", default=168)  # unpaid links are deactivated

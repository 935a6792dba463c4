"""Production mode (REFUNDOPS_ENV=production) starts locked down: no published secret, no sandbox,
no demo data; DJANGO_SECURE=true passes Django's deploy check. (Issue 9, findings 4 and 5.)

Settings are read once per process, so each mode is tried in a process of its own."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

from audit.models import AuditEntry
from processors.models import InboundEvent
from refundops.models import Payment
from tests.conftest import make_payment

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("DJANGO_SECRET_KEY", "REFUNDOPS_ENV", "DJANGO_DEBUG", "DJANGO_SECURE",
                                "SANDBOX_ENABLED", "SANDBOX_WEBHOOK_SECRET")}
    environment["AUDIT_KEY"] = secrets.token_urlsafe(40)  # production mode needs one (the audit chain's)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**environment, **env}, capture_output=True,
                          text=True, timeout=120)


def a_secret() -> str:
    return secrets.token_urlsafe(50)


def test_production_mode_refuses_to_start_without_a_secret_key():
    refused = run("manage.py", "check", REFUNDOPS_ENV="production")
    assert refused.returncode != 0 and "DJANGO_SECRET_KEY" in refused.stderr
    assert run("manage.py", "check", REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=a_secret()).returncode == 0


@pytest.mark.parametrize("published", ["change-me-in-production", "dev-only-insecure-secret-key-change-me",
                                       "django-insecure-" + "x" * 50, "too-short-to-be-random"])
def test_production_mode_refuses_a_published_or_weak_secret_key(published):
    refused = run("manage.py", "check", REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=published)
    assert refused.returncode != 0 and "DJANGO_SECRET_KEY" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.parametrize("low_entropy", ["a" * 50, "ab" * 25, "abcd" * 20])
def test_production_mode_refuses_a_long_secret_key_of_few_distinct_characters(low_entropy):
    """Length alone let ``'a' * 50`` through; Django's deploy check wants 5 distinct characters too."""
    refused = run("manage.py", "check", REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=low_entropy)
    assert refused.returncode != 0, refused.stdout
    assert "DJANGO_SECRET_KEY" in refused.stderr.strip().splitlines()[-1], refused.stderr[-2000:]


@pytest.mark.parametrize("fallback", ["dev-only-insecure-secret-key-change-me", "change-me-in-production", "a" * 50,
                                      "short"])
def test_production_mode_refuses_a_published_or_weak_fallback_key(fallback):
    """A fallback still verifies sessions and signed values: the published key there signs in anyone."""
    refused = run("manage.py", "check", REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=a_secret(),
                  DJANGO_SECRET_KEY_FALLBACKS=f"{a_secret()},{fallback}")
    assert refused.returncode != 0, refused.stdout
    last = refused.stderr.strip().splitlines()[-1]
    assert "DJANGO_SECRET_KEY_FALLBACKS" in last and fallback not in last, refused.stderr[-2000:]


def test_production_mode_starts_with_random_fallback_keys():
    """The refusals' counterpart, once rather than after each refusal (a check that passes loads the
    whole app: ~5 times a refused one's cost)."""
    assert run("manage.py", "check", REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=a_secret(),
               DJANGO_SECRET_KEY_FALLBACKS=f"{a_secret()},{a_secret()}").returncode == 0


@pytest.mark.parametrize("sandbox_secret", ["", "whsec_sandbox_dev"])
def test_the_sandbox_is_never_on_in_production_with_a_published_or_missing_secret(sandbox_secret):
    refused = run("manage.py", "check", REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=a_secret(),
                  SANDBOX_ENABLED="true", SANDBOX_WEBHOOK_SECRET=sandbox_secret)
    assert refused.returncode != 0 and "SANDBOX_WEBHOOK_SECRET" in refused.stderr


@pytest.mark.parametrize("mode", ["", "production"])
def test_the_deploy_check_passes_with_secure_settings(mode):
    result = run("manage.py", "check", "--deploy", "--fail-level", "WARNING", REFUNDOPS_ENV=mode,
                 DJANGO_DEBUG="false", DJANGO_SECRET_KEY=a_secret(), DJANGO_SECURE="true")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "no issues" in result.stdout


FORGE = """
import json, os, sys
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "refundops.settings"
django.setup()
from django.test import Client
from processors import signing
body = json.dumps(json.loads(sys.argv[1])).encode()
for path in ("/webhooks/sandbox/", "/webhooks/sandbox/default/"):
    answer = Client().post(path, data=body, content_type="application/json",
                           HTTP_SANDBOX_SIGNATURE=signing.sign(body, "whsec_sandbox_dev"))
    print(answer.status_code)
"""


@pytest.mark.django_db(transaction=True)
def test_a_forged_sandbox_dispute_signed_with_the_published_secret_is_refused_in_production_mode():
    payment = make_payment(amount=4_000)
    event = {"id": "sbevt_forged", "type": "dispute.created",
             "data": {"object": {"id": "sbdp_forged", "charge": payment.processor_reference, "status": "needs_response",
                                 "amount": 4_000, "currency": "usd", "reason": "fraudulent"}}}
    db = settings.DATABASES["default"]
    database_url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    answer = run("-c", FORGE, json.dumps(event), REFUNDOPS_ENV="production", DJANGO_SECRET_KEY=a_secret(),
                 DATABASE_URL=database_url)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.split() == ["404", "404"]
    payment.refresh_from_db()
    assert payment.dispute_status == Payment.Dispute.NONE
    assert not InboundEvent.objects.exists() and not AuditEntry.objects.filter(action="dispute.opened").exists()


def test_demo_data_refuses_in_production_mode_and_writes_nothing(settings):
    settings.PRODUCTION = True
    with pytest.raises(CommandError, match="production"):
        call_command("demo_data", "--json")
    assert not Payment.objects.exists() and not User.objects.exists()


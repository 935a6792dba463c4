"""What `scripts/run` prints once everything answers, read from the database it runs on.

Logins are shown only where the database accepts the demo password, payments only where they exist,
and the agent key only when this database accepts it: keys are stored hashed, so a key from
``--key-file`` that this database does not know is replaced by a new one for the demo agent
(development mode only) and written back to that file."""

from __future__ import annotations

import hmac
import json
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from processors.money import format_minor
from refundops.access import KEY_PREFIX_LENGTH, generate_key, hash_key
from refundops.management.commands.demo_data import DEMO_AGENT, DEMO_PASSWORD, write_atomically
from refundops.models import Agent, AgentKey, Payment, Refund, RefundState


# The example agent's hold: above the demo's approval threshold (200.00 USD), on a payment that large.
HOLD_EXAMPLE_MINOR = 30_000


class Command(BaseCommand):
    help = "Print how to reach this install and the demo logins and key its database accepts."

    def add_arguments(self, parser):
        parser.add_argument("--base-url", required=True)
        parser.add_argument("--key-file", type=Path, help="the demo key from an earlier start (JSON with agent.key)")

    def handle(self, *args, base_url: str, key_file: Path | None = None, **options):
        if settings.PRODUCTION:
            raise CommandError("run_banner is for development installs; production mode prints no logins or keys.")
        key, key_note = self._demo_key(key_file)
        out = [f"""
RefundOps is running.
  Admin      {base_url}/admin/   (the finance dashboard is linked from the admin index)
  API base   {base_url}/api/v1/  (OpenAPI: {base_url}/api/v1/schema/, interactive: {base_url}/api/v1/docs/)
  MCP        {base_url}/mcp      (streamable HTTP, same Bearer key)"""]
        out.append(f"  Agent key  {key}   (every agent capability{key_note})" if key else f"  {key_note}")
        logins = [u for u in User.objects.filter(is_active=True).order_by("pk") if u.check_password(DEMO_PASSWORD)]
        for user in logins:
            roles = ", ".join(sorted(user.groups.values_list("name", flat=True))) or "staff"
            out.append(f"  login {user.username:9} password {DEMO_PASSWORD}   ({roles})")
        others = User.objects.filter(is_active=True).count() - len(logins)
        if others:
            out.append(f"  {others} other login(s) sign in with their own passwords.")
        held = Refund.objects.filter(status=RefundState.HELD).count()
        if held:
            out.append(f"  {held} refund(s) wait for approval: {base_url}/admin/refundops/refund/?status__exact=held")
        example = self._example_payment()
        if key and example is not None:
            out.append(f"""
Try a refund:
  curl -s {base_url}/api/v1/refunds -H 'Authorization: Bearer {key}' \\
       -H 'Content-Type: application/json' \\
       -H "Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')" \\
       -d '{{"transaction_id": "{example.pk}", "amount": {min(1000, example.refundable_minor)}, "reason": "customer_request"}}'""")
            out.append(f"""Or let the example agent (MCP, a scripted conversation) do it:
  .venv/bin/python examples/agent/agent.py --url {base_url} --key {key} --payment {example.pk}""")
        held = self._example_payment(at_least=HOLD_EXAMPLE_MINOR)
        if key and held is not None:
            out.append(f"""To see a hold, ask {format_minor(HOLD_EXAMPLE_MINOR, held.currency)} back on the \
{format_minor(held.amount_captured_minor, held.currency)} payment ({shown(key_file) if key_file else "demo_data's JSON"} \
lists a payment for every path):
  .venv/bin/python examples/agent/agent.py --url {base_url} --key {key} --payment {held.pk} \
--amount {HOLD_EXAMPLE_MINOR}""")
        out.append(f"Logs: {shown(settings.VAR_DIR / 'web.log')}, {shown(settings.VAR_DIR / 'worker.log')}. "
                   "Ctrl-C stops.")
        self.stdout.write("\n".join(out))

    def _demo_key(self, key_file: Path | None) -> tuple[str, str]:
        """(a raw key this database accepts, a note), or ("", why there is none)."""
        agent = Agent.objects.filter(name=DEMO_AGENT, is_active=True).first()
        if agent is None:
            return "", ("No demo agent in this database: give an agent a key with "
                        "'manage.py create_agent' (the key is shown once).")
        live = AgentKey.objects.filter(agent=agent, revoked_at__isnull=True)
        candidate = ""
        if key_file is not None and key_file.exists():
            try:
                candidate = json.loads(key_file.read_text())["agent"]["key"]
            except (ValueError, KeyError, TypeError):
                candidate = ""
        if candidate and any(hmac.compare_digest(k.key_hash, hash_key(candidate))
                             for k in live.filter(prefix=candidate[:KEY_PREFIX_LENGTH])):
            return candidate, ""
        raw, prefix, digest = generate_key()
        AgentKey.objects.create(agent=agent, prefix=prefix, key_hash=digest)
        if key_file is not None:
            write_atomically(key_file, json.dumps({"agent": {"id": agent.pk, "name": agent.name, "key": raw,
                                                              "key_prefix": prefix}}, indent=2))
        return raw, "; a new key: keys are stored hashed and no earlier one was at hand"

    @staticmethod
    def _example_payment(*, at_least: int | None = None) -> Payment | None:
        """A recent captured payment with nothing refunded, no dispute and no fraud flag: below
        ``HOLD_EXAMPLE_MINOR`` (an agent refunds it whole without a hold), or of ``at_least``."""
        recent = timezone.now() - timedelta(days=30)
        size = {"amount_captured_minor__gte": at_least} if at_least else {
            "amount_captured_minor__gte": 1000, "amount_captured_minor__lt": HOLD_EXAMPLE_MINOR}
        return (Payment.objects.filter(status=Payment.Status.CAPTURED, captured_at__gte=recent,
                                       amount_refunded_minor=0, amount_reserved_minor=0,
                                       dispute_status=Payment.Dispute.NONE, fraud_flags=[],
                                       amount_owed_minor=0, customer__email_changed_at__isnull=True,
                                       currency="USD", **size)
                .order_by("-captured_at", "pk").first())


def shown(path: Path) -> str:
    """``path`` as scripts/run's user types it: relative to the checkout (where scripts/run runs)."""
    path = Path(path).resolve()
    return str(path.relative_to(settings.BASE_DIR)) if path.is_relative_to(settings.BASE_DIR) else str(path)

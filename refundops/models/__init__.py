"""The core domain, one module per aggregate: payments (customers, payments, voids and captures),
refunds (and their state machine), agents (and their keys), controls (finance's limits, fraud's
hold rules, the platform's switches), links (payment links, disputes) and webhooks (merchant
endpoints and deliveries). Everything is importable from ``refundops.models``."""

from refundops.models.agents import Agent, AgentKey, Capability, new_agent_id
from refundops.models.merchants import DEFAULT_MERCHANT_ID, AgentRead, Merchant, new_merchant_id
from refundops.models.attempts import GatewayAttempt, new_gateway_attempt_id
from refundops.models.controls import BacktestRun, HoldRules, PlatformState, PolicyDraft, RefundLimits, new_policy_draft_id
from refundops.models.links import (
    Dispute,
    DisputeEvidenceDraft,
    PaymentLink,
    PaymentLinkTemplate,
    new_dispute_id,
    new_evidence_draft_id,
    new_link_template_id,
    new_payment_link_id,
)
from refundops.models.payments import (
    Customer,
    GatewayCustomer,
    Payment,
    PaymentOperation,
    new_customer_id,
    new_payment_id,
    new_payment_operation_id,
)
from refundops.models.outbox import OutboxMessage
from refundops.models.reconciliation import LedgerDiscrepancy, new_discrepancy_id
from refundops.models.refunds import (
    COUNTING_STATES,
    RESERVING_STATES,
    IdempotencyRecord,
    Reason,
    Refund,
    RefundState,
    new_refund_id,
)
from refundops.models.totals import BUCKET_SECONDS, RefundTotalDelta
from refundops.models.webhooks import MerchantEndpoint, WebhookDelivery, new_delivery_id, new_endpoint_id, new_webhook_secret

__all__ = [
    "DEFAULT_MERCHANT_ID", "AgentRead", "Merchant", "new_merchant_id",
    "BUCKET_SECONDS", "COUNTING_STATES", "RESERVING_STATES", "Agent", "AgentKey", "Capability", "Customer", "Dispute",
    "DisputeEvidenceDraft", "GatewayAttempt", "GatewayCustomer", "HoldRules", "LedgerDiscrepancy", "IdempotencyRecord", "MerchantEndpoint", "OutboxMessage", "Payment",
    "BacktestRun", "PaymentLink", "PaymentLinkTemplate", "PaymentOperation", "PlatformState", "PolicyDraft", "Reason", "Refund", "RefundLimits",
    "RefundState", "RefundTotalDelta", "WebhookDelivery", "new_agent_id", "new_customer_id", "new_discrepancy_id", "new_delivery_id", "new_dispute_id",
    "new_endpoint_id", "new_evidence_draft_id", "new_gateway_attempt_id", "new_link_template_id", "new_payment_id", "new_payment_link_id",
    "new_payment_operation_id", "new_policy_draft_id", "new_refund_id", "new_webhook_secret",
]

"""The admin for finance, fraud, operators and auditors, one module per audience.

Everything that moves money or access goes through the services (request_refund, approve_refund,
reject_refund, the agent switches), so the admin writes the same verdicts, history and audit
entries as the API. Rows those services own are read-only here, and history never reverts.
"""

from refundops.admin import agents, drafts, evidence, payments, policy, reconciliation, refunds, webhooks  # noqa: F401  (each registers its pages)

from refundops import admin_policy  # noqa: F401  (finance's limits and fraud's rules)

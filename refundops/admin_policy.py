"""Admin for finance's refund limits and fraud's hold rules."""

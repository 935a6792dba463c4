"""Held refunds and the named people with the authority to approve them."""

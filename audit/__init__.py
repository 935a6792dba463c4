"""Verdicts, the append-only audit log and reports. The ground floor: imports nothing above it."""

"""The floor: the same project and database, serving only bench.floor's bare refund view."""

from bench.settings_full import *  # noqa: F403

ROOT_URLCONF = "bench.floor"

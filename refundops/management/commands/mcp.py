"""``manage.py mcp``: the MCP tools over stdio, for the agent key in ``REFUNDOPS_AGENT_KEY``."""

from __future__ import annotations

import os

import anyio
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from mcp.server.stdio import stdio_server

from refundops.access import authenticate_key
from refundops.errors import ApiError
from refundops.mcp_server import build_server, fixed_key

KEY_VARIABLE = "REFUNDOPS_AGENT_KEY"


class Command(BaseCommand):
    help = (f"Serve the MCP tools over stdio (stdin/stdout) for the agent key in {KEY_VARIABLE}. "
            "The key is checked again on every call, so revoking it stops this server's agent at once.")

    def handle(self, *args, **options) -> None:
        raw = os.environ.get(KEY_VARIABLE, "").strip()
        if not raw:
            raise CommandError(f"Set {KEY_VARIABLE} to the agent key (rk_…) this server acts for.")
        try:
            key = authenticate_key(raw)
        except ApiError as error:
            raise CommandError(f"{KEY_VARIABLE}: {error.message}") from None
        connection.close()  # each tool call opens its own; this one would sit idle for the whole session
        # stdout carries the protocol: anything else goes to stderr.
        self.stderr.write(f"RefundOps MCP over stdio for agent {key.agent.name} (key {key.prefix}…).")
        server = build_server(fixed_key(raw))

        async def serve() -> None:
            async with stdio_server() as (read_stream, write_stream):
                await server.run(read_stream, write_stream, server.create_initialization_options())

        anyio.run(serve)

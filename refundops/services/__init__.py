"""Writes: one function per operation, verb first. Views, MCP tools, admin actions and tasks all
call these; nothing here knows about HTTP."""

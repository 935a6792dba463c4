"""gunicorn's worker for refundops.asgi (gunicorn.conf.py): uvicorn's, taking one new connection each
time its event loop wakes for the listening socket rather than every one waiting.

All workers share the socket gunicorn listens on. asyncio accepts up to ``backlog`` connections
in one go each time the socket is ready (uvicorn passes gunicorn's ``backlog``, 2048 by default),
so the first worker to wake takes every connection waiting: 32 clients connecting at once all
landed on one worker of four (``ss`` counted [32], [18, 14], [32] in three tries, issue 11), and a
keep-alive connection stays where it landed, so one process (one GIL) served all of them while
three idled. Here asyncio is told to accept one at a time; the kernel's queue keeps gunicorn's
``backlog``; the workers race for each connection, and a worker busy with Python wakes later and
takes fewer."""

from __future__ import annotations

import socket
from typing import Any

from uvicorn_worker import UvicornWorker as _UvicornWorker


class OneAcceptAtATime:
    """A listening socket as asyncio sees it: ``listen(n)`` keeps the kernel's queue at ``backlog``
    whatever asyncio asks for; everything else is the socket's."""

    def __init__(self, sock: Any, backlog: int) -> None:
        self._sock, self._backlog = sock, backlog

    def listen(self, _backlog: int = 0) -> None:
        self._sock.listen(self._backlog)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class UvicornWorker(_UvicornWorker):
    ACCEPTS_PER_WAKE = 1

    async def _serve(self) -> None:
        backlog = self.cfg.backlog
        self.sockets = [OneAcceptAtATime(s, backlog) if s.type == socket.SOCK_STREAM else s for s in self.sockets]
        self.config.backlog = self.ACCEPTS_PER_WAKE  # asyncio's accept loop: connections per wake-up
        await super()._serve()

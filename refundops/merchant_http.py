"""POSTing to a merchant's URL without letting the URL reach inside our network.

A merchant endpoint is a URL someone typed. Its host is resolved when we connect (not only when it
was saved: DNS can change between the two), every address it resolves to is checked, and the
connection goes to the checked address itself, so a second lookup cannot swap in another one.
Loopback, private, link-local (169.254.169.254 is the cloud metadata service), shared, reserved,
multicast and unspecified addresses are refused, IPv4 inside IPv6 too. The call has one deadline
for connecting, sending and reading, and at most ``MAX_RESPONSE_BYTES`` of the answer are read;
only its status and size are kept, never its body.

``MERCHANT_WEBHOOK_ALLOW_PRIVATE=true`` lifts the address check, for a merchant receiver on this
machine in development and tests; production refuses to start with it.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

import urllib3
from django.conf import settings
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import HTTPError, NewConnectionError

MAX_RESPONSE_BYTES = 64 * 1024


class AddressRefused(Exception):
    """The URL's host is, or resolves to, an address a merchant endpoint may not be."""


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no HTTP answer (refused, unreachable, past the deadline)
    size: int  # bytes of the answer read (at most MAX_RESPONSE_BYTES + 1)
    error: str  # empty when the merchant answered 2xx within the deadline


def refused_reason(address: str) -> str | None:
    """Why ``address`` (an IP) may not be called, or None when it is a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for name in ("loopback", "link_local", "unspecified", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{name}"):
            return f"{ip} is a {name.replace('_', '-')} address"
    if not ip.is_global:
        return f"{ip} is not a public address"
    return None


def checked_address(host: str, port: int) -> tuple[int, str]:
    """(family, address) to connect to for ``host``: every address it resolves to must be public."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise AddressRefused(f"{host} does not resolve ({exc.strerror})") from None
    if getattr(settings, "MERCHANT_WEBHOOK_ALLOW_PRIVATE", False):
        return found[0][0], found[0][4][0]
    for _, _, _, _, sockaddr in found:
        reason = refused_reason(sockaddr[0])
        if reason:
            raise AddressRefused(f"{host} resolves to {sockaddr[0]}: {reason.split(' is ', 1)[1]}")
    return found[0][0], found[0][4][0]


class _CheckedConnect:
    """urllib3's connection, connecting only to the address :func:`checked_address` approved. TLS
    still names and verifies the URL's host (``self.host``)."""

    def _new_conn(self) -> socket.socket:
        try:
            family, address = checked_address(self._dns_host, self.port)
        except AddressRefused as refused:
            raise NewConnectionError(self, str(refused)) from None
        sock = socket.socket(family, socket.SOCK_STREAM)
        # urllib3's own socket options (TCP_NODELAY): it sends the body after the headers, and
        # without them Nagle's algorithm holds the body for the server's delayed ACK, ~40 ms a call.
        for option in self.socket_options or ():
            sock.setsockopt(*option)
        sock.settimeout(self.timeout)
        try:
            sock.connect((address, self.port))
        except OSError as exc:
            sock.close()
            raise NewConnectionError(self, f"could not connect to {address}: {exc}") from None
        return sock


class _HTTP(_CheckedConnect, HTTPConnection):
    pass


class _HTTPS(_CheckedConnect, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTP


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPS


def _pool_manager() -> urllib3.PoolManager:
    manager = urllib3.PoolManager(num_pools=10, maxsize=4)
    manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
    return manager


_MANAGER = _pool_manager()


def post(url: str, body: bytes, headers: dict[str, str], *, deadline_seconds: float) -> Answer:
    """POST ``body`` to ``url`` within ``deadline_seconds`` overall; never follows a redirect."""
    started = time.monotonic()

    def left() -> float:
        return deadline_seconds - (time.monotonic() - started)

    try:
        response = _MANAGER.request("POST", url, body=body, headers=headers, redirect=False, retries=False,
                                    preload_content=False,
                                    timeout=urllib3.Timeout(connect=deadline_seconds, read=deadline_seconds))
    except NewConnectionError as exc:
        return Answer(None, 0, f"refused: {str(exc).split(': ', 1)[-1]}"[:1000])
    except (HTTPError, OSError, ValueError) as exc:
        return Answer(None, 0, f"{type(exc).__name__}: {exc}"[:1000])
    size = 0
    try:
        while size <= MAX_RESPONSE_BYTES:
            if left() <= 0:
                return Answer(response.status, size, f"HTTP {response.status}: no complete answer within "
                                                     f"{deadline_seconds:g} seconds ({size} bytes read)")
            chunk = response.read(8192, decode_content=False)
            if not chunk:
                break
            size += len(chunk)
    except (HTTPError, OSError) as exc:
        return Answer(response.status, size, f"HTTP {response.status}: the answer broke off after {size} bytes "
                                             f"({type(exc).__name__})")
    finally:
        response.close()  # never read the rest of an answer we do not want
    if size > MAX_RESPONSE_BYTES:
        return Answer(response.status, size, f"HTTP {response.status}: answer over {MAX_RESPONSE_BYTES} bytes; "
                                             f"not read further")
    if not 200 <= response.status < 300:
        return Answer(response.status, size, f"HTTP {response.status} ({size} bytes)")
    return Answer(response.status, size, "")

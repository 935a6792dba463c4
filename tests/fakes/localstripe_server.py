"""``localstripe`` (a stateful fake Stripe nobody on this project wrote), patched only where it
lacks normal Stripe API, and served: ``python -m tests.fakes.localstripe_server --port N``.

tests/test_localstripe.py starts it as a subprocess. The patches, each a gap in localstripe
1.15.10 against Stripe's published API:

- it keeps its objects in a pickle at a fixed path (``/tmp/localstripe.pickle``) that every run on
  the machine shares: kept in memory here instead;
- no ``Idempotency-Key``: a POST repeated with the key answers the first answer again
  (``Idempotent-Replayed: true``); the key with other parameters is a 400 ``idempotency_error``;
- a refund takes no ``reason``: taken (one of Stripe's three) and shown;
- capturing a payment intent takes no ``metadata``: taken and merged;
- a payment intent has no ``amount_received``: shown (what its charge captured);
- listing payment intents takes no ``created`` filter and lists oldest first: ``created[gt|gte|lt|lte]``
  filter, newest first, as Stripe lists;
- no disputes at all: ``GET /v1/disputes`` answers an empty list (there is no way to open one).

What localstripe does differently and is left as it is (the tests do not lean on it): it refunds
more than was captured, it shows a partial capture's release as a refund, and a charge has no
``amount_captured``, ``disputed`` or card details (our adapter reads those as unknown and asks).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from localstripe import resources
from localstripe.errors import UserError

# -- before the server module builds its routes from these ----------------------------------------

resources.Store.dump_to_disk = lambda self: None
resources.Store.try_load_from_disk = lambda self: None

REFUND_REASONS = ("duplicate", "fraudulent", "requested_by_customer")
_refund_init = resources.Refund.__init__


def _refund_with_reason(self: Any, reason: str | None = None, **kwargs: Any) -> None:
    if reason is not None and reason not in REFUND_REASONS:
        raise UserError(400, "Invalid reason: must be one of duplicate, fraudulent, or requested_by_customer",
                        {"param": "reason"})
    _refund_init(self, **kwargs)
    self.reason = reason


resources.Refund.__init__ = _refund_with_reason

_capture = resources.PaymentIntent._api_capture.__func__


def _capture_with_metadata(id: str, metadata: dict[str, str] | None = None, **kwargs: Any) -> Any:
    intent = _capture(resources.PaymentIntent, id, **kwargs)
    intent.metadata.update(metadata or {})
    return intent


resources.extra_apis[:] = [(method, url, _capture_with_metadata if url == "/v1/payment_intents/{id}/capture"
                            else func) for method, url, func in resources.extra_apis]

resources.PaymentIntent.amount_received = property(
    lambda self: self.latest_charge.amount if self.status == "succeeded" else 0)

_COMPARE = {"gt": int.__gt__, "gte": int.__ge__, "lt": int.__lt__, "lte": int.__le__}


def _list_payment_intents(cls: Any, url: str, limit: Any = None, starting_after: Any = None,
                          created: Any = None, **kwargs: Any) -> Any:
    listed = resources.StripeObject._api_list_all.__func__(cls, url, limit=limit, **kwargs)
    bounds = created if isinstance(created, dict) else {"gte": created, "lte": created} if created else {}
    listed._list = sorted((pi for pi in listed._list
                           if all(_COMPARE[op](pi.created, int(value)) for op, value in bounds.items())),
                          key=lambda pi: pi.created, reverse=True)
    listed._starting_after = starting_after
    return listed


resources.PaymentIntent._api_list_all = classmethod(_list_payment_intents)

from localstripe import server  # noqa: E402  (builds its routes from the patched resources)

_replies: dict[str, tuple[str, bytes, int, bytes]] = {}


@web.middleware
async def _idempotency(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.headers.get("Idempotency-Key")
    if request.method != "POST" or not key:
        return await handler(request)
    body = await request.read()
    if key in _replies:
        path, first, status, answer = _replies[key]
        if (path, first) != (request.path, body):
            return web.json_response({"error": {
                "type": "idempotency_error",
                "message": "Keys for idempotent requests can only be used with the same parameters they were "
                           f"first used with. Try using a key other than '{key}' if you meant to execute a "
                           "different request."}}, status=400)
        return web.Response(body=answer, status=status, content_type="application/json",
                            headers={"Idempotent-Replayed": "true"})
    response = await handler(request)
    if isinstance(response, web.Response) and response.body is not None and response.status < 500:
        _replies[key] = (request.path, body, response.status, bytes(response.body))
    return response


async def _list_disputes(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [], "has_more": False, "url": "/v1/disputes"})


server.app.middlewares.append(_idempotency)
server.app.router.add_get("/v1/disputes", _list_disputes)

if __name__ == "__main__":
    server.start()

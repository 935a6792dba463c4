"""A small stateful Stripe for tests, spoken to by the official ``stripe`` SDK over HTTP.

It speaks the published API's shapes: form-encoded POSTs with bracketed nested keys, objects
shaped like Stripe's own examples (``stripe/openapi`` fixtures3.json, MIT), the one error object
``{"error": {"type", "code", "message", "param"}}`` with Stripe's status codes, and idempotency
keys stored with the first answer (same key, same parameters: that answer again with
``Idempotent-Replayed: true``; same key, other parameters: 400 ``idempotency_error``). It refuses
to refund more than a charge captured, as Stripe does. Lists page newest first with ``limit`` and
``starting_after`` and take Stripe's filters (``payment_intent``, ``charge``, ``created``) and
``expand[]``; an unknown parameter is refused as Stripe refuses it (400 ``parameter_unknown``).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from tests.fakes import FakeGateway, Request, Response

REFUND_REASONS = ("duplicate", "fraudulent", "requested_by_customer")
CANCELABLE = ("requires_payment_method", "requires_capture", "requires_confirmation",
              "requires_action", "processing")
CANCELLATION_REASONS = ("duplicate", "fraudulent", "requested_by_customer", "abandoned")
# Stripe's dispute evidence: text fields take up to 20,000 characters (150,000 in all); file fields
# take the id of an uploaded file (file_…).
EVIDENCE_TEXT = ("access_activity_log", "billing_address", "cancellation_policy_disclosure",
                 "cancellation_rebuttal", "customer_email_address", "customer_name", "customer_purchase_ip",
                 "duplicate_charge_explanation", "duplicate_charge_id", "product_description",
                 "refund_policy_disclosure", "refund_refusal_explanation", "service_date", "shipping_address",
                 "shipping_carrier", "shipping_date", "shipping_tracking_number", "uncategorized_text")
EVIDENCE_FILES = ("cancellation_policy", "customer_communication", "customer_signature",
                  "duplicate_charge_documentation", "receipt", "refund_policy", "service_documentation",
                  "shipping_documentation", "uncategorized_file")
# Where evidence can still be given, and where submitting it moves the dispute.
SUBMITTED = {"needs_response": "under_review", "warning_needs_response": "warning_under_review"}


class _Refusal(Exception):
    """A request refused before the endpoint ran: its answer is not stored under the key."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


def stripe_error(status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> Response:
    error: dict[str, Any] = {"type": type, "message": message}
    if code:
        error["code"] = code
        error["doc_url"] = f"https://stripe.com/docs/error-codes/{code.replace('_', '-')}"
    if param:
        error["param"] = param
    return _json(status, {"error": error})


def _json(status: int, body: Any) -> Response:
    return Response(status, json.dumps(body).encode(),
                    {"Content-Type": "application/json",
                     "Request-Id": f"req_{secrets.token_hex(7)}"})


def parse_form(raw: str) -> dict[str, Any]:
    """``metadata[a]=1&line_items[0][quantity]=1`` → ``{"metadata": {"a": "1"},
    "line_items": [{"quantity": "1"}]}``: how Stripe reads its form-encoded parameters."""
    root: dict[str, Any] = {}
    for key, value in parse_qsl(raw, keep_blank_values=True):
        parts = re.findall(r"[^\[\]]+", key)
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {key: _listify(value) for key, value in node.items()}
    if node and all(key.isdigit() for key in node):
        return [node[key] for key in sorted(node, key=int)]
    return node


def _new_id(prefix: str) -> str:
    return f"{prefix}_3Fk{secrets.token_hex(10)}"


def _int(params: dict[str, Any], name: str, *, minimum: int = 0, default: int | None = None) -> int:
    raw = params.get(name)
    if raw is None:
        if default is None:
            raise _Refusal(stripe_error(400, f"Missing required param: {name}.",
                                        code="parameter_missing", param=name))
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise _Refusal(stripe_error(400, f"Invalid integer: {raw}", code="parameter_invalid_integer",
                                    param=name)) from None
    if value < minimum:
        raise _Refusal(stripe_error(400, f"This value must be greater than or equal to {minimum}.",
                                    code="parameter_invalid_integer", param=name))
    return value


def _missing(kind: str, object_id: str, param: str = "id") -> Response:
    return stripe_error(404, f"No such {kind}: '{object_id}'", code="resource_missing", param=param)


def _money_text(amount: int, currency: str) -> str:
    # Stripe states amounts in major units in its messages; the tests' messages are in usd.
    return f"${amount // 100}.{amount % 100:02d}" if currency == "usd" else f"{amount} {currency}"


class FakeStripe(FakeGateway):
    name = "stripe"

    def __init__(self, *, api_key: str = "sk_test_fake") -> None:
        super().__init__()
        self.api_key = api_key
        self.payment_intents: dict[str, dict[str, Any]] = {}
        self.charges: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.disputes: dict[str, dict[str, Any]] = {}
        self.products: dict[str, dict[str, Any]] = {}
        self.prices: dict[str, dict[str, Any]] = {}
        self.payment_links: dict[str, dict[str, Any]] = {}
        self.next_refund_status = "succeeded"
        self._refuse_next: tuple[int, Response] | None = None  # (requests to let through first, answer)
        self._idempotency: dict[str, tuple[str, str, dict[str, Any], Response]] = {}
        self._routes: list[tuple[str, re.Pattern[str], Callable[..., Response]]] = [
            ("POST", re.compile(r"/v1/refunds"), self._create_refund),
            ("GET", re.compile(r"/v1/refunds"), self._list_refunds),
            ("GET", re.compile(r"/v1/refunds/(?P<id>[^/]+)"), self._get_refund),
            ("GET", re.compile(r"/v1/payment_intents"), self._list_payment_intents),
            ("GET", re.compile(r"/v1/payment_intents/(?P<id>[^/]+)"), self._get_intent),
            ("GET", re.compile(r"/v1/charges/(?P<id>[^/]+)"), self._get_charge),
            ("POST", re.compile(r"/v1/payment_intents/(?P<id>[^/]+)/cancel"), self._cancel_intent),
            ("POST", re.compile(r"/v1/payment_intents/(?P<id>[^/]+)/capture"), self._capture_intent),
            ("GET", re.compile(r"/v1/disputes"), self._list_disputes),
            ("GET", re.compile(r"/v1/disputes/(?P<id>[^/]+)"), self._get_dispute),
            ("POST", re.compile(r"/v1/disputes/(?P<id>[^/]+)"), self._update_dispute),
            ("POST", re.compile(r"/v1/prices"), self._create_price),
            ("POST", re.compile(r"/v1/payment_links"), self._create_payment_link),
            ("POST", re.compile(r"/v1/payment_links/(?P<id>[^/]+)"), self._update_payment_link),
        ]

    # -- control API for tests -------------------------------------------------------------------
    def add_payment_intent(self, amount: int, currency: str = "usd", *, captured: bool = True,
                           created: int | None = None, customer: str | None = None) -> str:
        """A confirmed payment intent with its charge: captured, or authorised and awaiting
        capture (``requires_capture``)."""
        with self.lock:
            intent_id = _new_id("pi")
            charge_id = self._charge(amount, currency, captured=captured, payment_intent=intent_id)
            self.payment_intents[intent_id] = {
                "id": intent_id, "object": "payment_intent", "amount": amount,
                "amount_capturable": 0 if captured else amount,
                "amount_received": amount if captured else 0,
                "capture_method": "automatic" if captured else "manual",
                "canceled_at": None, "cancellation_reason": None,
                "created": created if created is not None else int(time.time()),
                "currency": currency, "customer": customer, "description": None,
                "latest_charge": charge_id, "livemode": False, "metadata": {},
                "payment_method": f"pm_{secrets.token_hex(8)}", "payment_method_types": ["card"],
                "status": "succeeded" if captured else "requires_capture",
            }
            return intent_id

    def refund_directly(self, payment: str, amount: int | None = None, *, reason: str | None = None,
                        created: int | None = None, metadata: dict[str, str] | None = None,
                        status: str = "succeeded") -> str:
        """A refund made outside RefundOps (the Dashboard, another system) of a payment intent or
        charge, as Stripe then lists it."""
        with self.lock:
            key = "payment_intent" if payment.startswith("pi_") else "charge"
            params: dict[str, Any] = {key: payment, "metadata": metadata or {}}
            if amount is not None:
                params["amount"] = str(amount)
            if reason is not None:
                params["reason"] = reason
            before, self.next_refund_status = self.next_refund_status, status
            try:
                answer = self._create_refund(params)
            finally:
                self.next_refund_status = before
            assert answer.status == 200, answer.body
            refund = json.loads(answer.body)
            if created is not None:
                self.refunds[refund["id"]]["created"] = created
            return refund["id"]

    def refuse_next(self, status: int, message: str, *, type: str = "invalid_request_error",
                    code: str | None = None, param: str | None = None, after: int = 0) -> None:
        """Answer one request, the next after ``after`` more, with this Stripe error, whatever it asks."""
        with self.lock:
            self._refuse_next = (after, stripe_error(status, message, type=type, code=code, param=param))

    def pay_payment_link(self, link_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """A customer pays through a link: the completed Checkout Session and the payment intent
        it made, which carries the link's ``payment_intent_data.metadata`` as Stripe copies it."""
        with self.lock:
            link = self.payment_links[link_id]
            if not link["active"]:
                raise ValueError(f"{link_id} is deactivated: Stripe shows the customer that it has expired")
            amount = sum(item["amount_total"] for item in link["line_items"])
            intent_id = self.add_payment_intent(amount, link["currency"])
            intent = self.payment_intents[intent_id]
            intent["metadata"] = dict(link["payment_intent_data"]["metadata"])
            session = {
                "id": _new_id("cs_test"), "object": "checkout.session", "amount_total": amount,
                "currency": link["currency"], "livemode": False, "metadata": dict(link["metadata"]),
                "mode": "payment", "payment_intent": intent_id, "payment_link": link_id,
                "payment_status": "paid", "status": "complete",
            }
            return session, dict(intent)

    def add_charge(self, amount: int, currency: str = "usd") -> str:
        """A captured charge made without a payment intent (the older Charges API)."""
        with self.lock:
            return self._charge(amount, currency, captured=True, payment_intent=None)

    def add_dispute(self, charge_id: str, *, reason: str = "fraudulent",
                    status: str = "needs_response", due_by: int | None = None) -> str:
        with self.lock:
            charge = self.charges[charge_id]
            dispute_id = _new_id("dp")
            charge["disputed"] = True
            self.disputes[dispute_id] = {
                "id": dispute_id, "object": "dispute", "amount": charge["amount_captured"],
                "balance_transactions": [], "charge": charge_id, "created": int(time.time()),
                "currency": charge["currency"], "evidence": {},
                "evidence_details": {"due_by": due_by or int(time.time()) + 7 * 86400,
                                     "has_evidence": False, "past_due": False,
                                     "submission_count": 0},
                "is_charge_refundable": False, "livemode": False, "metadata": {},
                "payment_intent": charge["payment_intent"], "reason": reason, "status": status,
            }
            return dispute_id

    def close_dispute(self, dispute_id: str, status: str) -> None:
        """The bank decides: ``won`` or ``lost`` (``warning_closed`` for an inquiry)."""
        with self.lock:
            self.disputes[dispute_id]["status"] = status

    def set_refund_status(self, refund_id: str, status: str, *, failure_reason: str = "") -> None:
        """Move a refund as Stripe may later (``failed`` gives the amount back to the charge)."""
        with self.lock:
            refund = self.refunds[refund_id]
            if status in ("failed", "canceled") and refund["status"] not in ("failed", "canceled"):
                self.charges[refund["charge"]]["amount_refunded"] -= refund["amount"]
            refund["status"] = status
            if status == "failed":
                refund["failure_reason"] = failure_reason or "unknown"

    @property
    def refund_count(self) -> int:
        """How many refunds were really created (replays of a key do not count)."""
        with self.lock:
            return len(self.refunds)

    # -- failure modes ---------------------------------------------------------------------------
    def unavailable(self) -> Response:
        return stripe_error(503, "Stripe is temporarily unavailable. Please try again later.",
                            type="api_error")

    def rate_limited(self) -> Response:
        return stripe_error(429, "Request rate limit exceeded. Learn more about rate limits here "
                            "https://stripe.com/docs/rate-limits.", code="rate_limit")

    # -- dispatch --------------------------------------------------------------------------------
    def idempotency_key(self, request: Request) -> str | None:
        return request.header("Idempotency-Key") if request.method == "POST" else None

    def key_in_use(self) -> Response:
        # Stripe's answer while another request with the same key is still being processed.
        return stripe_error(409, "There is currently another in-progress request using this Stripe-Idempotency-Key. "
                            "Please try again later.", code="idempotency_key_in_use")

    def forget_idempotency_keys(self) -> None:
        """Stripe keeps keys 24 hours: after that, a request with an old key is a new request."""
        with self.lock:
            self._idempotency.clear()

    def handle(self, request: Request) -> Response:
        if self._refuse_next is not None:
            after, refusal = self._refuse_next
            self._refuse_next = (after - 1, refusal) if after else None
            if not after:
                return refusal
        if request.header("Authorization") != f"Bearer {self.api_key}":
            return stripe_error(401, "Invalid API Key provided: "
                                f"{(request.header('Authorization') or '')[7:15]}****")
        for method, pattern, endpoint in self._routes:
            match = pattern.fullmatch(request.path)
            if match and method == request.method:
                break
        else:
            return stripe_error(404, f"Unrecognized request URL ({request.method}: {request.path}).")
        raw = request.body.decode() if request.method == "POST" else request.query
        params = parse_form(raw)
        key = request.header("Idempotency-Key") if request.method == "POST" else None
        if key and key in self._idempotency:
            path, method, first_params, answer = self._idempotency[key]
            if (path, method, first_params) != (request.path, request.method, params):
                return stripe_error(
                    400, "Keys for idempotent requests can only be used with the same parameters "
                    f"they were first used with. Try using a key other than '{key}' if you meant "
                    "to execute a different request.", type="idempotency_error")
            return Response(answer.status, answer.body,
                            {**answer.headers, "Idempotent-Replayed": "true"})
        try:
            response = endpoint(params, **match.groupdict())
        except _Refusal as refusal:
            return refusal.response
        if key:
            response.headers["Idempotency-Key"] = key
            self._idempotency[key] = (request.path, request.method, params, response)
        return response

    # -- endpoints -------------------------------------------------------------------------------
    def _create_refund(self, params: dict[str, Any]) -> Response:
        charge_id, intent_id = params.get("charge"), params.get("payment_intent")
        if not charge_id and not intent_id:
            raise _Refusal(stripe_error(400, "One of the following params should be provided for "
                                        "this request: payment_intent or charge.",
                                        code="parameter_missing"))
        if intent_id:
            intent = self.payment_intents.get(intent_id)
            if intent is None:
                return _missing("payment_intent", intent_id, "payment_intent")
            if intent["status"] != "succeeded":
                return stripe_error(400, "This PaymentIntent does not have a successful charge "
                                    "to refund.", code="charge_not_refundable", param="payment_intent")
            if charge_id and charge_id != intent["latest_charge"]:
                return stripe_error(400, "The charge does not belong to this PaymentIntent.",
                                    param="charge")
            charge_id = intent["latest_charge"]
        charge = self.charges.get(charge_id)
        if charge is None:
            return _missing("charge", charge_id, "charge")
        reason = params.get("reason")
        if reason is not None and reason not in REFUND_REASONS:
            raise _Refusal(stripe_error(400, "Invalid reason: must be one of duplicate, fraudulent, "
                                        "or requested_by_customer", param="reason"))
        remaining = charge["amount_captured"] - charge["amount_refunded"]
        amount = _int(params, "amount", minimum=1, default=remaining or 1)
        if remaining <= 0:
            return stripe_error(400, f"Charge {charge_id} has already been refunded.",
                                code="charge_already_refunded")
        if amount > remaining:
            return stripe_error(
                400, f"Refund amount ({_money_text(amount, charge['currency'])}) is greater than "
                f"unrefunded amount on charge ({_money_text(remaining, charge['currency'])})",
                code="amount_too_large", param="amount")
        charge["amount_refunded"] += amount
        charge["refunded"] = charge["amount_refunded"] == charge["amount_captured"]
        refund_id = _new_id("re")
        refund = {
            "id": refund_id, "object": "refund", "amount": amount,
            "balance_transaction": _new_id("txn"), "charge": charge_id,
            "created": int(time.time()), "currency": charge["currency"],
            "destination_details": {"card": {"reference_status": "pending",
                                             "reference_type": "acquirer_reference_number",
                                             "type": "refund"}, "type": "card"},
            "metadata": params.get("metadata") or {}, "payment_intent": charge["payment_intent"],
            "reason": reason, "receipt_number": None, "source_transfer_reversal": None,
            "status": self.next_refund_status, "transfer_reversal": None,
        }
        self.refunds[refund_id] = refund
        return _json(200, refund)

    def _get_refund(self, params: dict[str, Any], id: str) -> Response:
        refund = self.refunds.get(id)
        return _json(200, refund) if refund else _missing("refund", id)

    def _list_refunds(self, params: dict[str, Any]) -> Response:
        """``GET /v1/refunds``: newest first, optionally of one charge or payment intent."""
        limit = _int(params, "limit", minimum=1, default=10)
        if limit > 100:
            raise _Refusal(stripe_error(400, "This value must be less than or equal to 100.",
                                        code="parameter_invalid_integer", param="limit"))
        refunds = [refund for refund in self.refunds.values()
                   if params.get("charge") in (None, refund["charge"])
                   and params.get("payment_intent") in (None, refund["payment_intent"])]
        order = {refund_id: n for n, refund_id in enumerate(self.refunds)}  # ties in one second: newest last made
        refunds.sort(key=lambda refund: (refund["created"], order[refund["id"]]), reverse=True)
        after = params.get("starting_after")
        if after:
            ids = [refund["id"] for refund in refunds]
            if after not in ids:
                raise _Refusal(_missing("refund", after, "starting_after"))
            refunds = refunds[ids.index(after) + 1:]
        return _json(200, {"object": "list", "data": refunds[:limit], "has_more": len(refunds) > limit,
                           "url": "/v1/refunds"})

    def _get_intent(self, params: dict[str, Any], id: str) -> Response:
        intent = self.payment_intents.get(id)
        return _json(200, intent) if intent else _missing("payment_intent", id, "intent")

    def _get_charge(self, params: dict[str, Any], id: str) -> Response:
        charge = self.charges.get(id)
        return _json(200, charge) if charge else _missing("charge", id)

    def _cancel_intent(self, params: dict[str, Any], id: str) -> Response:
        intent = self.payment_intents.get(id)
        if intent is None:
            return _missing("payment_intent", id, "intent")
        reason = params.get("cancellation_reason")
        if reason is not None and reason not in CANCELLATION_REASONS:
            raise _Refusal(stripe_error(400, f"Invalid cancellation_reason: {reason}",
                                        param="cancellation_reason"))
        if intent["status"] not in CANCELABLE:
            return stripe_error(
                400, "You cannot cancel this PaymentIntent because it has a status of "
                f"{intent['status']}. Only a PaymentIntent with one of the following statuses may "
                f"be canceled: {', '.join(CANCELABLE)}.", code="payment_intent_unexpected_state")
        intent.update(status="canceled", canceled_at=int(time.time()),
                      cancellation_reason=reason, amount_capturable=0)
        return _json(200, intent)

    def _capture_intent(self, params: dict[str, Any], id: str) -> Response:
        intent = self.payment_intents.get(id)
        if intent is None:
            return _missing("payment_intent", id, "intent")
        if intent["status"] != "requires_capture":
            return stripe_error(
                400, "This PaymentIntent could not be captured because it has a status of "
                f"{intent['status']}. Only a PaymentIntent with one of the following statuses may "
                "be captured: requires_capture.", code="payment_intent_unexpected_state")
        amount = _int(params, "amount_to_capture", minimum=1, default=intent["amount_capturable"])
        if amount > intent["amount_capturable"]:
            return stripe_error(400, "The amount_to_capture cannot be greater than the amount "
                                "capturable.", code="amount_too_large", param="amount_to_capture")
        intent.update(status="succeeded", amount_received=amount, amount_capturable=0)
        intent["metadata"].update(params.get("metadata") or {})
        charge = self.charges[intent["latest_charge"]]
        charge.update(captured=True, amount_captured=amount)
        return _json(200, intent)

    def _list_payment_intents(self, params: dict[str, Any]) -> Response:
        self._known(params, "created", "expand", "limit", "starting_after")
        created = params.get("created")
        bounds = created if isinstance(created, dict) else {"gte": created, "lte": created}
        checks = {"gt": int.__gt__, "gte": int.__ge__, "lt": int.__lt__, "lte": int.__le__}
        intents = [intent for intent in self.payment_intents.values()
                   if all(checks[op](intent["created"], int(value))
                          for op, value in bounds.items() if value is not None)]
        expand = params.get("expand") or []
        for path in expand:
            if path != "data.latest_charge":
                raise _Refusal(stripe_error(400, f"This property cannot be expanded ({path}).",
                                            param="expand"))
        page = self._page(intents, params, "/v1/payment_intents", "payment_intent")
        if expand:
            page["data"] = [{**intent, "latest_charge": self.charges.get(intent["latest_charge"])}
                            for intent in page["data"]]
        return _json(200, page)

    def _list_disputes(self, params: dict[str, Any]) -> Response:
        self._known(params, "charge", "payment_intent", "limit", "starting_after")
        disputes = list(self.disputes.values())
        for name in ("payment_intent", "charge"):
            if params.get(name):
                disputes = [d for d in disputes if d[name] == params[name]]
        return _json(200, self._page(disputes, params, "/v1/disputes", "dispute"))

    def _update_dispute(self, params: dict[str, Any], id: str) -> Response:
        """Evidence is staged on the dispute; ``submit`` (Stripe's default: true) sends it to the
        bank, after which the dispute is under review and takes no more."""
        self._known(params, "evidence", "metadata", "submit", "expand")
        dispute = self.disputes.get(id)
        if dispute is None:
            return _missing("dispute", id)
        evidence = params.get("evidence") or {}
        for name, value in evidence.items():
            if name not in EVIDENCE_TEXT + EVIDENCE_FILES:
                raise _Refusal(stripe_error(400, f"Received unknown parameter: evidence[{name}]",
                                            code="parameter_unknown", param=f"evidence[{name}]"))
            if name in EVIDENCE_TEXT and len(value) > 20_000:
                raise _Refusal(stripe_error(400, "This value must be at most 20000 characters long.",
                                            code="string_length_exceeded", param=f"evidence[{name}]"))
            if name in EVIDENCE_FILES and not str(value).startswith("file_"):
                raise _Refusal(_missing("file", str(value), f"evidence[{name}]"))
        if sum(len(v) for k, v in evidence.items() if k in EVIDENCE_TEXT) > 150_000:
            raise _Refusal(stripe_error(400, "The combined length of all evidence fields must be at most "
                                        "150000 characters.", param="evidence"))
        if dispute["status"] not in SUBMITTED:
            return stripe_error(400, f"This dispute is {dispute['status']} and can no longer be updated "
                                "with evidence.", param="evidence")
        dispute["evidence"].update(evidence)
        dispute["metadata"].update(params.get("metadata") or {})
        if params.get("submit", "true") == "true":
            dispute["status"] = SUBMITTED[dispute["status"]]
            details = dispute["evidence_details"]
            details.update(has_evidence=True, submission_count=details["submission_count"] + 1)
        return _json(200, dispute)

    def _update_payment_link(self, params: dict[str, Any], id: str) -> Response:
        self._known(params, "active", "metadata", "inactive_message")
        link = self.payment_links.get(id)
        if link is None:
            return _missing("payment_link", id)
        if "active" in params:
            if params["active"] not in ("true", "false"):
                raise _Refusal(stripe_error(400, f"Invalid boolean: {params['active']}",
                                            code="parameter_invalid_boolean", param="active"))
            link["active"] = params["active"] == "true"
        link["metadata"].update(params.get("metadata") or {})
        return _json(200, {key: value for key, value in link.items() if key != "line_items"})

    def _get_dispute(self, params: dict[str, Any], id: str) -> Response:
        dispute = self.disputes.get(id)
        return _json(200, dispute) if dispute else _missing("dispute", id)

    def _create_price(self, params: dict[str, Any]) -> Response:
        return _json(200, self._price(params, "price"))

    def _create_payment_link(self, params: dict[str, Any]) -> Response:
        items = params.get("line_items")
        if not isinstance(items, list) or not items:
            raise _Refusal(stripe_error(400, "Missing required param: line_items.",
                                        code="parameter_missing", param="line_items"))
        prices = []
        for index, item in enumerate(items):
            name = f"line_items[{index}]"
            _int(item, "quantity", minimum=1)
            if "price" in item:
                price = self.prices.get(item["price"])
                if price is None:
                    raise _Refusal(_missing("price", item["price"], f"{name}[price]"))
            elif isinstance(item.get("price_data"), dict):
                price = self._price(item["price_data"], f"{name}[price_data]")
            else:
                raise _Refusal(stripe_error(400, f"You must specify either `price` or `price_data` "
                                            f"in {name}.", code="parameter_missing", param=name))
            prices.append(price)
        if len({price["currency"] for price in prices}) > 1:
            raise _Refusal(stripe_error(400, "All prices on a payment link must share a currency.",
                                        param="line_items"))
        link_id = _new_id("plink")
        link = {
            "id": link_id, "object": "payment_link", "active": True,
            "after_completion": {"hosted_confirmation": {"custom_message": None},
                                 "type": "hosted_confirmation"},
            "allow_promotion_codes": False, "currency": prices[0]["currency"],
            "livemode": False, "metadata": params.get("metadata") or {},
            "payment_intent_data": {"capture_method": None, "description": None,
                                    "metadata": (params.get("payment_intent_data") or {})
                                    .get("metadata") or {}},
            "url": f"https://buy.stripe.com/test_{secrets.token_urlsafe(12)}",
        }
        self.payment_links[link_id] = {
            **link, "line_items": [{"price": price["id"], "quantity": int(item["quantity"]),
                                    "amount_total": price["unit_amount"] * int(item["quantity"])}
                                   for price, item in zip(prices, items)]}
        return _json(200, link)

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _known(params: dict[str, Any], *names: str) -> None:
        for name in params:
            if name not in names:
                raise _Refusal(stripe_error(400, f"Received unknown parameter: {name}",
                                            code="parameter_unknown", param=name))

    def _page(self, objects: list[dict[str, Any]], params: dict[str, Any], url: str,
              kind: str) -> dict[str, Any]:
        """One page of a Stripe list: newest first (ids break ties), ``limit`` 1..100 (10 unless
        given), after ``starting_after``."""
        limit = _int(params, "limit", minimum=1, default=10)
        if limit > 100:
            raise _Refusal(stripe_error(400, "This value must be less than or equal to 100.",
                                        code="parameter_invalid_integer", param="limit"))
        objects = sorted(objects, key=lambda obj: (obj["created"], obj.get("id", "")), reverse=True)
        after = params.get("starting_after")
        if after:
            ids = [obj.get("id") for obj in objects]
            if after not in ids:
                raise _Refusal(_missing(kind, after, "starting_after"))
            objects = objects[ids.index(after) + 1:]
        return {"object": "list", "data": objects[:limit], "has_more": len(objects) > limit, "url": url}

    def _charge(self, amount: int, currency: str, *, captured: bool,
                payment_intent: str | None) -> str:
        charge_id = _new_id("ch")
        self.charges[charge_id] = {
            "id": charge_id, "object": "charge", "amount": amount,
            "amount_captured": amount if captured else 0, "amount_refunded": 0,
            "captured": captured, "currency": currency, "disputed": False,
            "payment_intent": payment_intent,
            "payment_method_details": {"card": {"brand": "visa", "country": "US", "exp_month": 8,
                                                "exp_year": 2030, "funding": "credit", "last4": "4242",
                                                "network": "visa"}, "type": "card"},
            "refunded": False, "status": "succeeded",
        }
        return charge_id

    def _price(self, data: dict[str, Any], name: str) -> dict[str, Any]:
        currency = data.get("currency")
        if not currency:
            raise _Refusal(stripe_error(400, "Missing required param: currency.",
                                        code="parameter_missing", param=f"{name}[currency]"))
        unit_amount = _int(data, "unit_amount", minimum=0)
        product_id = data.get("product")
        if product_id is None:
            product_name = (data.get("product_data") or {}).get("name")
            if not product_name:
                raise _Refusal(stripe_error(400, "Missing required param: product_data[name].",
                                            code="parameter_missing",
                                            param=f"{name}[product_data][name]"))
            product_id = _new_id("prod")
            self.products[product_id] = {"id": product_id, "object": "product", "active": True,
                                         "name": product_name, "type": "service"}
        elif product_id not in self.products:
            raise _Refusal(_missing("product", product_id, f"{name}[product]"))
        price_id = _new_id("price")
        price = {
            "id": price_id, "object": "price", "active": True, "billing_scheme": "per_unit",
            "created": int(time.time()), "currency": currency, "livemode": False,
            "lookup_key": None, "metadata": {}, "nickname": None, "product": product_id,
            "recurring": None, "tax_behavior": "unspecified", "type": "one_time",
            "unit_amount": unit_amount, "unit_amount_decimal": str(unit_amount),
        }
        self.prices[price_id] = price
        return price

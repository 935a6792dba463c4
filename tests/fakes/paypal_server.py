"""A small stateful PayPal for tests, spoken to by the official ``paypal-server-sdk`` over HTTP.

It speaks the published REST shapes: OAuth client credentials at ``/v1/oauth2/token``, Payments v2
captures, authorisations and refunds with amounts as decimal strings checked the way PayPal checks
them, PayPal's error object (``name``, ``message``, ``debug_id``, ``details[].issue``), replays
for a repeated ``PayPal-Request-Id``, and a ``/v1/notifications/verify-webhook-signature`` that
decides whether a transmission it signed (:meth:`FakePayPal.sign_webhook`) is genuine.

Real PayPal signs with its RSA certificate; the fake signs the same fields
(``transmission_id|transmission_time|webhook_id|crc32(event)``) with an HMAC key of its own, which
is enough for a verifier that, like ours, asks the gateway rather than checking locally.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import string
import zlib
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any
from urllib.parse import parse_qsl

from tests.fakes import FakeGateway, Request, Response

# PayPal's currencies; HUF, JPY and TWD take no decimals there, every other one at most two.
CURRENCIES = frozenset({"AUD", "BRL", "CAD", "CNY", "CZK", "DKK", "EUR", "HKD", "HUF", "ILS", "JPY",
                        "MYR", "MXN", "TWD", "NZD", "NOK", "PHP", "PLN", "GBP", "SGD", "SEK", "CHF",
                        "THB", "USD"})
NO_DECIMALS = frozenset({"HUF", "JPY", "TWD"})
VALUE = re.compile(r"^((-?[0-9]+)|(-?([0-9]+)?[.][0-9]+))$")  # PayPal's own pattern
CERT_URL = "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-360caa42-fca2a594-a5cafa77"
DOCS = "https://developer.paypal.com/docs/api/payments/v2/"
EVIDENCE_TYPES = frozenset({"PROOF_OF_FULFILLMENT", "PROOF_OF_REFUND", "PROOF_OF_DELIVERY_SIGNATURE",
                            "PROOF_OF_RECEIPT_COPY", "RETURN_POLICY", "BILLING_AGREEMENT", "PROOF_OF_RESHIPMENT",
                            "ITEM_DESCRIPTION", "POLICE_REPORT", "AFFIDAVIT", "PAID_WITH_OTHER_METHOD",
                            "COPY_OF_CONTRACT", "TERMINAL_ATM_RECEIPT", "PRICE_DIFFERENCE_REASON",
                            "SOURCE_CONVERSION_RATE", "BANK_STATEMENT", "CREDIT_DUE_REASON",
                            "REQUEST_CREDIT_RECEIPT", "PROOF_OF_RETURN", "CREATE", "CHANGE_REASON",
                            "PROOF_OF_REFUND_OUTSIDE_PAYPAL", "RECEIPT_OF_MERCHANDISE", "CUSTOMS_DOCUMENT",
                            "CUSTOMS_FEE_RECEIPT", "INFORMATION_ON_RESOLUTION", "OTHER"})

MESSAGES = {
    "INVALID_REQUEST": "Request is not well-formed, syntactically incorrect, or violates schema.",
    "UNPROCESSABLE_ENTITY": "The requested action could not be performed, semantically incorrect, "
                            "or failed business validation.",
    "RESOURCE_NOT_FOUND": "The specified resource does not exist.",
}


class _Problem(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(body).encode(),
                    {"Content-Type": "application/json",
                     "Paypal-Debug-Id": secrets.token_hex(7), **(headers or {})})


def paypal_error(status: int, name: str, issue: str | None = None, description: str = "", *,
                 field: str | None = None, location: str = "body") -> Response:
    body: dict[str, Any] = {"name": name, "message": MESSAGES.get(name, name.replace("_", " ")),
                            "debug_id": secrets.token_hex(7)}
    if issue:
        detail: dict[str, Any] = {"issue": issue, "description": description or issue}
        if field:
            detail.update(field=field, location=location)
        body["details"] = [detail]
        body["links"] = [{"href": f"{DOCS}#error-{issue}", "rel": "information_link",
                          "method": "GET"}]
    return _json(status, body)


def _new_id() -> str:
    return "".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(17))


def _now(later: timedelta = timedelta(0)) -> str:
    return (datetime.now(timezone.utc) + later).strftime("%Y-%m-%dT%H:%M:%SZ")


def _money(value: Decimal, currency: str) -> dict[str, str]:
    places = 0 if currency in NO_DECIMALS else 2
    return {"currency_code": currency, "value": f"{value:.{places}f}"}


def _form_parts(request: Request) -> dict[str, str]:
    """A multipart/form-data body as {part name: its text}."""
    head = f"Content-Type: {request.header('Content-Type')}\r\n\r\n".encode()
    message = BytesParser(policy=HTTP).parsebytes(head + request.body)
    if not message.is_multipart():
        raise ValueError("not multipart")
    return {str(part.get_param("name", header="content-disposition")): part.get_payload(decode=True).decode()
            for part in message.iter_parts()}


def _canonical(event: Any) -> bytes:
    return json.dumps(event, sort_keys=True, separators=(",", ":")).encode()


class FakePayPal(FakeGateway):
    name = "paypal"

    def __init__(self, *, client_id: str = "fake-client", client_secret: str = "fake-secret",
                 webhook_max_age: timedelta = timedelta(minutes=5)) -> None:
        super().__init__()
        self.client_id = client_id
        self.client_secret = client_secret
        self.webhook_max_age = webhook_max_age
        self.captures: dict[str, dict[str, Any]] = {}
        self.authorizations: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.orders: dict[str, dict[str, Any]] = {}
        self.disputes: dict[str, dict[str, Any]] = {}
        self.tokens_issued = 0
        self.next_refund_status = "COMPLETED"
        self._tokens: set[str] = set()
        self._signing_key = secrets.token_bytes(32)
        self._replays: dict[tuple[str, str, str], Response] = {}
        self._routes: list[tuple[str, re.Pattern[str], Callable[..., Response]]] = [
            ("POST", re.compile(r"/v2/payments/captures/(?P<id>[^/]+)/refund"), self._refund),
            ("GET", re.compile(r"/v2/payments/refunds/(?P<id>[^/]+)"), self._get_refund),
            ("GET", re.compile(r"/v2/payments/captures/(?P<id>[^/]+)"), self._get_capture),
            ("GET", re.compile(r"/v2/checkout/orders/(?P<id>[^/]+)"), self._get_order),
            ("GET", re.compile(r"/v2/payments/authorizations/(?P<id>[^/]+)"), self._get_authorization),
            ("POST", re.compile(r"/v2/payments/authorizations/(?P<id>[^/]+)/void"), self._void),
            ("POST", re.compile(r"/v2/payments/authorizations/(?P<id>[^/]+)/capture"), self._capture),
            ("POST", re.compile(r"/v1/notifications/verify-webhook-signature"), self._verify),
            ("GET", re.compile(r"/v1/customer/disputes"), self._list_disputes),
            ("GET", re.compile(r"/v1/customer/disputes/(?P<id>[^/]+)"), self._get_dispute),
            ("GET", re.compile(r"/v1/reporting/transactions"), self._search_transactions),
            ("POST", re.compile(r"/v1/customer/disputes/(?P<id>[^/]+)/provide-evidence"), self._provide_evidence),
        ]

    # -- control API for tests -------------------------------------------------------------------
    def add_capture(self, value: str, currency: str = "USD", *, with_order: bool = True,
                    created: datetime | None = None, payer: dict[str, str] | None = None,
                    invoice_id: str | None = None, custom_id: str | None = None) -> str:
        """A completed capture of ``value`` (PayPal's decimal string), ready to refund: of an order
        paid at once, or (``with_order=False``) one made before the Orders API, with no order.
        ``payer`` (``account_id``, ``email_address``, ``name``) is what the reporting API shows of
        the buyer."""
        with self.lock:
            order_id = self._new_order("CAPTURE", Decimal(value), currency) if with_order else None
            capture_id = self._new_capture(Decimal(value), currency, authorization_id=None, order_id=order_id)
            capture = self.captures[capture_id]
            capture.update(invoice_id=invoice_id, custom_id=custom_id, payer=payer)
            if created is not None:
                capture["create_time"] = capture["update_time"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
            return capture_id

    def refund_directly(self, capture_id: str, value: str | None = None, *, custom_id: str | None = None,
                        created: datetime | None = None, status: str = "COMPLETED") -> str:
        """A refund made outside RefundOps (PayPal's site, another system)."""
        with self.lock:
            body: dict[str, Any] = {"custom_id": custom_id} if custom_id else {}
            if value is not None:
                body["amount"] = {"currency_code": self.captures[capture_id]["amount"]["currency_code"],
                                  "value": value}
            before, self.next_refund_status = self.next_refund_status, status
            try:
                answer = self._refund(body, Request("POST", "", "", {}, b""), capture_id)
            finally:
                self.next_refund_status = before
            assert answer.status == 201, answer.body
            refund_id = json.loads(answer.body)["id"]
            if created is not None:
                self.refunds[refund_id]["create_time"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
            return refund_id

    def add_authorization(self, value: str, currency: str = "USD") -> str:
        """An authorisation of an order placed with ``intent: AUTHORIZE``, waiting for capture."""
        with self.lock:
            authorization_id = _new_id()
            self.authorizations[authorization_id] = {
                "id": authorization_id, "status": "CREATED", "amount": _money(Decimal(value), currency),
                "captured": Decimal(0), "create_time": _now(), "update_time": _now(),
                "expiration_time": _now(timedelta(days=29)),
                "order_id": self._new_order("AUTHORIZE", Decimal(value), currency),
            }
            return authorization_id

    def capture_authorization(self, authorization_id: str, value: str, *, final_capture: bool = True) -> str:
        """Capture (part of) an authorisation as the merchant would; the capture's id."""
        with self.lock:
            currency = self.authorizations[authorization_id]["amount"]["currency_code"]
            response = self._capture({"amount": _money(Decimal(value), currency), "final_capture": final_capture},
                                     None, authorization_id)
            return json.loads(response.body)["id"]

    def set_refund_status(self, refund_id: str, status: str) -> None:
        with self.lock:
            refund = self.refunds[refund_id]
            if status in ("FAILED", "CANCELLED") and refund["status"] not in ("FAILED", "CANCELLED"):
                self.captures[refund["capture_id"]]["refunded"] -= Decimal(refund["amount"]["value"])
            refund["status"] = status
            refund["update_time"] = _now()

    def add_dispute(self, capture_id: str, *, reason: str = "MERCHANDISE_OR_SERVICE_NOT_RECEIVED") -> str:
        """A buyer's dispute of the whole capture, waiting for the seller's response."""
        with self.lock:
            capture = self.captures[capture_id]
            dispute_id = f"PP-D-{secrets.randbelow(10**6):06d}"
            self.disputes[dispute_id] = {
                "dispute_id": dispute_id, "create_time": _now(), "update_time": _now(),
                "disputed_transactions": [{"seller_transaction_id": capture_id,
                                           "create_time": capture["create_time"],
                                           "transaction_status": "COMPLETED",
                                           "gross_amount": capture["amount"]}],
                "reason": reason, "status": "WAITING_FOR_SELLER_RESPONSE",
                "dispute_amount": capture["amount"], "dispute_life_cycle_stage": "CHARGEBACK",
                "dispute_channel": "EXTERNAL", "seller_response_due_date": _now(timedelta(days=10)),
            }
            return dispute_id

    def resolve_dispute(self, dispute_id: str, outcome_code: str) -> None:
        """Close a dispute, e.g. ``RESOLVED_SELLER_FAVOUR`` (won) or ``RESOLVED_BUYER_FAVOUR`` (lost)."""
        with self.lock:
            dispute = self.disputes[dispute_id]
            dispute.update(status="RESOLVED", update_time=_now(),
                           dispute_outcome={"outcome_code": outcome_code})
            dispute.pop("seller_response_due_date", None)

    def forget_request_ids(self) -> None:
        """What PayPal does once a request id is older than it keeps them (45 days for a capture's
        refund): the same ``PayPal-Request-Id`` is then a new request."""
        with self.lock:
            self._replays.clear()

    def dispute_event(self, event_type: str, dispute_id: str) -> dict[str, Any]:
        """A ``CUSTOMER.DISPUTE.*`` webhook event as PayPal sends it: the dispute as its resource."""
        with self.lock:
            resource = json.loads(json.dumps(self.disputes[dispute_id]))
        return {"id": f"WH-{_new_id()}", "event_version": "1.0", "resource_type": "dispute",
                "event_type": event_type, "summary": f"Dispute {dispute_id}", "create_time": _now(),
                "resource": resource}

    @property
    def refund_count(self) -> int:
        """How many refunds were really created (replays of a request id do not count)."""
        with self.lock:
            return len(self.refunds)

    def sign_webhook(self, event: dict[str, Any], *, webhook_id: str,
                     transmission_time: datetime | None = None) -> dict[str, str]:
        """The transmission headers PayPal would send with ``event`` for ``webhook_id``."""
        when = (transmission_time or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
        transmission_id = f"{secrets.token_hex(4)}-{secrets.token_hex(2)}-11ef-{secrets.token_hex(6)}"
        return {
            "PAYPAL-AUTH-ALGO": "SHA256withRSA",
            "PAYPAL-CERT-URL": CERT_URL,
            "PAYPAL-TRANSMISSION-ID": transmission_id,
            "PAYPAL-TRANSMISSION-SIG": self._signature(transmission_id, when, webhook_id, event),
            "PAYPAL-TRANSMISSION-TIME": when,
        }

    # -- failure modes ---------------------------------------------------------------------------
    def unavailable(self) -> Response:
        return _json(503, {"name": "SERVICE_UNAVAILABLE", "message": "Service Unavailable.",
                           "debug_id": secrets.token_hex(7)})

    def rate_limited(self) -> Response:
        return _json(429, {"name": "RATE_LIMIT_REACHED",
                           "message": "Too many requests. Blocked due to rate limiting.",
                           "debug_id": secrets.token_hex(7)})

    # -- dispatch --------------------------------------------------------------------------------
    def handle(self, request: Request) -> Response:
        if request.method == "POST" and request.path == "/v1/oauth2/token":
            return self._token(request)
        authorization = request.header("Authorization") or ""
        if authorization.removeprefix("Bearer ") not in self._tokens:
            return _json(401, {"name": "AUTHENTICATION_FAILURE",
                               "message": "Authentication failed due to invalid authentication "
                                          "credentials or a missing Authorization header.",
                               "links": [{"href": "https://developer.paypal.com/docs/api/overview"
                                                  "/#error", "rel": "information_link"}]})
        for method, pattern, endpoint in self._routes:
            match = pattern.fullmatch(request.path)
            if match and method == request.method:
                break
        else:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.")
        request_id = request.header("PayPal-Request-Id")
        replay_key = (request.method, request.path, request_id or "")
        if request_id and replay_key in self._replays:
            # PayPal answers a repeated request id with the first result, body unexamined.
            return self._replays[replay_key]
        try:
            if (request.header("Content-Type") or "").startswith("multipart/form-data"):
                body = _form_parts(request)
            else:
                body = json.loads(request.body) if request.body.strip() else {}
            response = endpoint(body, request, **match.groupdict())
        except ValueError:
            return paypal_error(400, "INVALID_REQUEST", "MALFORMED_REQUEST_JSON",
                                "The request JSON is not well formed.")
        except _Problem as problem:
            return problem.response
        if request_id and 200 <= response.status < 300:
            self._replays[replay_key] = response
        return response

    # -- endpoints -------------------------------------------------------------------------------
    def _token(self, request: Request) -> Response:
        expected = base64.b64encode(f"{self.client_id}:{self.client_secret}".encode()).decode()
        form = dict(parse_qsl(request.body.decode()))
        if request.header("Authorization") != f"Basic {expected}":
            return _json(401, {"error": "invalid_client",
                               "error_description": "Client Authentication failed"})
        if form.get("grant_type") != "client_credentials":
            return _json(400, {"error": "unsupported_grant_type",
                               "error_description": "Grant Type is NULL"})
        token = f"A21AA{secrets.token_urlsafe(24)}"
        self._tokens.add(token)
        self.tokens_issued += 1
        return _json(200, {"scope": "https://uri.paypal.com/services/payments/refund",
                           "access_token": token, "token_type": "Bearer",
                           "app_id": "APP-80W284485P519543T", "expires_in": 32400,
                           "nonce": f"{_now()}{secrets.token_hex(8)}"})

    def _refund(self, body: dict[str, Any], request: Request, id: str) -> Response:
        capture = self.captures.get(id)
        if capture is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="capture_id",
                                location="path")
        currency = capture["amount"]["currency_code"]
        remaining = Decimal(capture["amount"]["value"]) - capture["refunded"]
        if remaining <= 0:
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "CAPTURE_FULLY_REFUNDED",
                                "The capture has already been fully refunded.")
        value = remaining
        if "amount" in body:
            value = self._amount(body["amount"], "/amount")
            if body["amount"]["currency_code"] != currency:
                return paypal_error(422, "UNPROCESSABLE_ENTITY", "REFUND_CAPTURE_CURRENCY_MISMATCH",
                                    "Refund must be in the same currency as the capture.",
                                    field="/amount/currency_code")
        if value <= 0:
            return paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_VALUE",
                                "The refund amount must be positive.", field="/amount/value")
        if value > remaining:
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "REFUND_AMOUNT_EXCEEDED",
                                "The refund amount must be less than or equal to the capture "
                                "amount that has not yet been refunded.")
        custom_id = body.get("custom_id")
        if custom_id is not None and len(custom_id) > 127:
            return paypal_error(400, "INVALID_REQUEST", "INVALID_STRING_MAX_LENGTH",
                                "The value of a field is too long.", field="/custom_id")
        capture["refunded"] += value
        fully = capture["refunded"] == Decimal(capture["amount"]["value"])
        capture["status"] = "REFUNDED" if fully else "PARTIALLY_REFUNDED"
        refund_id = _new_id()
        refund = {
            "id": refund_id, "amount": _money(value, currency), "status": self.next_refund_status,
            "seller_payable_breakdown": {"gross_amount": _money(value, currency),
                                         "net_amount": _money(value, currency),
                                         "total_refunded_amount": _money(capture["refunded"], currency)},
            "custom_id": custom_id, "note_to_payer": body.get("note_to_payer"),
            "capture_id": id, "create_time": _now(), "update_time": _now(),
            "links": [{"href": f"{self.url}/v2/payments/refunds/{refund_id}", "rel": "self",
                       "method": "GET"},
                      {"href": f"{self.url}/v2/payments/captures/{id}", "rel": "up",
                       "method": "GET"}],
        }
        self.refunds[refund_id] = refund
        return _json(201, self._representation(refund))

    def _get_refund(self, body: dict[str, Any], request: Request, id: str) -> Response:
        refund = self.refunds.get(id)
        if refund is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="refund_id",
                                location="path")
        return _json(200, self._representation(refund))

    def _get_capture(self, body: dict[str, Any], request: Request, id: str) -> Response:
        capture = self.captures.get(id)
        if capture is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="capture_id",
                                location="path")
        return _json(200, self._representation(capture))

    def _get_order(self, body: dict[str, Any], request: Request, id: str) -> Response:
        """An order with its purchase unit's payment history: every authorisation, capture and
        refund made of it, each linking ``up`` to what it came from."""
        order = self.orders.get(id)
        if order is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="order_id", location="path")
        captures = [c for c in self.captures.values() if c.get("order_id") == id]
        capture_ids = {c["id"] for c in captures}
        payments = {
            "authorizations": [self._representation(a) for a in self.authorizations.values()
                               if a.get("order_id") == id],
            "captures": [self._representation(c) for c in captures],
            "refunds": [self._representation(r) for r in self.refunds.values() if r["capture_id"] in capture_ids],
        }
        unit = {**order["purchase_units"][0], "payments": {k: v for k, v in payments.items() if v}}
        return _json(200, {**order, "purchase_units": [unit]})

    def _get_dispute(self, body: dict[str, Any], request: Request, id: str) -> Response:
        dispute = self.disputes.get(id)
        if dispute is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="dispute_id",
                                location="path")
        return _json(200, dispute)

    def _provide_evidence(self, body: dict[str, Any], request: Request, id: str) -> Response:
        """The seller's evidence: a multipart body whose ``input`` part is JSON ``{"evidences": […]}``,
        each with an ``evidence_type`` and notes of at most 2,000 characters (documents, the other
        parts, are not kept here). Taken only while the dispute waits for the seller."""
        dispute = self.disputes.get(id)
        if dispute is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="dispute_id", location="path")
        if "input" not in body:
            return paypal_error(400, "INVALID_REQUEST", "MISSING_REQUIRED_PARAMETER",
                                "A required field is missing.", field="input")
        evidences = json.loads(body["input"]).get("evidences")
        if not isinstance(evidences, list) or not evidences:
            return paypal_error(400, "INVALID_REQUEST", "MISSING_REQUIRED_PARAMETER",
                                "A required field is missing.", field="/evidences")
        for index, evidence in enumerate(evidences):
            if evidence.get("evidence_type") not in EVIDENCE_TYPES:
                return paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_VALUE",
                                    "The value of a field is invalid.", field=f"/evidences/{index}/evidence_type")
            if len(evidence.get("notes") or "") > 2000:
                return paypal_error(400, "INVALID_REQUEST", "INVALID_STRING_MAX_LENGTH",
                                    "The value of a field is too long.", field=f"/evidences/{index}/notes")
        if dispute["status"] != "WAITING_FOR_SELLER_RESPONSE":
            # PayPal drops the provide-evidence link; it refuses the call as not allowed now.
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "NOT_ALLOWED",
                                f"Evidence cannot be provided for a dispute that is {dispute['status']}.")
        dispute.setdefault("evidences", []).extend(
            {**evidence, "source": "SUBMITTED_BY_SELLER", "date": _now()} for evidence in evidences)
        dispute.update(status="UNDER_REVIEW", update_time=_now())
        return _json(200, {"links": [{"href": f"{self.url}/v1/customer/disputes/{id}", "rel": "self",
                                      "method": "GET"}]})

    def _search_transactions(self, body: dict[str, Any], request: Request) -> Response:
        """``GET /v1/reporting/transactions``: the balance-affecting transactions initiated between
        ``start_date`` and ``end_date`` (at most 31 days apart), oldest first, ``page`` (from 1) of
        ``page_size`` (1..500, 100 unless given). Captures are T0006, refunds T1107 with a
        negative amount and the capture as ``paypal_reference_id``; status S, P, V or D."""
        query = dict(parse_qsl(request.query))
        try:
            start, end = (datetime.fromisoformat(query[name].replace("Z", "+00:00"))
                          for name in ("start_date", "end_date"))
        except KeyError as missing:
            return paypal_error(400, "INVALID_REQUEST", "MISSING_REQUIRED_PARAMETER",
                                f"{missing.args[0]} is required.", field=missing.args[0], location="query")
        except ValueError:
            return paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_SYNTAX",
                                "Dates must be in Internet date and time format.", location="query")
        if not timedelta(0) <= end - start <= timedelta(days=31):
            return paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_VALUE",
                                "Date range is greater than 31 days or end_date is before start_date.",
                                field="end_date", location="query")
        page, page_size = int(query.get("page", 1)), int(query.get("page_size", 100))
        if page < 1 or not 1 <= page_size <= 500:
            return paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_VALUE",
                                "page must be at least 1 and page_size 1 to 500.", location="query")
        rows = [row for row in self._transactions() if start <= row[0] <= end]
        rows.sort(key=lambda row: (row[0], row[1]["transaction_info"]["transaction_id"]))
        total_pages = max(1, -(-len(rows) // page_size))
        details = [row[1] for row in rows[(page - 1) * page_size:page * page_size]]
        if query.get("fields") != "all":  # only transaction_info unless all fields are asked for
            details = [{"transaction_info": d["transaction_info"]} for d in details]
        return _json(200, {"transaction_details": details, "account_number": "ZXCVBNM1234",
                           "start_date": query["start_date"], "end_date": query["end_date"],
                           "last_refreshed_datetime": _now(), "page": page, "total_items": len(rows),
                           "total_pages": total_pages, "links": []})

    def _transactions(self) -> list[tuple[datetime, dict[str, Any]]]:
        def when(stamp: str) -> datetime:
            return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)

        def stamp(moment: datetime) -> str:  # the reporting API's own form, e.g. 2026-01-02T03:04:05+0000
            return moment.strftime("%Y-%m-%dT%H:%M:%S+0000")

        statuses = {"COMPLETED": "S", "PENDING": "P", "FAILED": "D", "CANCELLED": "D"}
        rows = []
        for capture in self.captures.values():
            moment = when(capture["create_time"])
            payer = capture.get("payer") or {}
            info = {"paypal_account_id": payer.get("account_id"), "transaction_id": capture["id"],
                    "transaction_event_code": "T0006", "transaction_initiation_date": stamp(moment),
                    "transaction_updated_date": stamp(moment), "transaction_amount": capture["amount"],
                    "transaction_status": "S" if capture["status"] != "PENDING" else "P",
                    "invoice_id": capture.get("invoice_id"), "custom_field": capture.get("custom_id"),
                    "protection_eligibility": "01"}
            name = payer.get("name")
            rows.append((moment, {
                "transaction_info": {k: v for k, v in info.items() if v is not None},
                "payer_info": {k: v for k, v in {
                    "account_id": payer.get("account_id"), "email_address": payer.get("email_address"),
                    "payer_name": {"alternate_full_name": name} if name else None}.items() if v}}))
        for refund in self.refunds.values():
            moment = when(refund["create_time"])
            amount = refund["amount"]
            info = {"transaction_id": refund["id"], "paypal_reference_id": refund["capture_id"],
                    "paypal_reference_id_type": "TXN", "transaction_event_code": "T1107",
                    "transaction_initiation_date": stamp(moment), "transaction_updated_date": stamp(moment),
                    "transaction_amount": {"currency_code": amount["currency_code"], "value": f"-{amount['value']}"},
                    "transaction_status": statuses.get(refund["status"], "P"), "custom_field": refund.get("custom_id")}
            rows.append((moment, {"transaction_info": {k: v for k, v in info.items() if v is not None},
                                  "payer_info": {}}))
        return rows

    def _list_disputes(self, body: dict[str, Any], request: Request) -> Response:
        """``GET /v1/customer/disputes``: summaries, newest first, ``page`` (from 1) of ``page_size``
        (1..50, 10 unless given), created at or after ``create_time_after`` when given."""
        query = dict(parse_qsl(request.query))
        page, page_size = int(query.get("page", 1)), int(query.get("page_size", 10))
        if page < 1 or not 1 <= page_size <= 50:
            return paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_VALUE",
                                "page must be at least 1 and page_size 1 to 50.", location="query")
        after = query.get("create_time_after")
        disputes = [d for d in self.disputes.values() if not after or d["create_time"] >= after.replace(".000", "")]
        disputes.sort(key=lambda d: (d["create_time"], d["dispute_id"]), reverse=True)
        items = [{key: d[key] for key in ("dispute_id", "create_time", "update_time", "reason", "status",
                                          "dispute_amount", "dispute_life_cycle_stage", "dispute_channel")}
                 for d in disputes[(page - 1) * page_size:page * page_size]]
        links = [{"href": f"{self.url}/v1/customer/disputes?page={page + 1}&page_size={page_size}",
                  "rel": "next", "method": "GET"}] if page * page_size < len(disputes) else []
        return _json(200, {"items": items, "links": links})

    def _void(self, body: dict[str, Any], request: Request, id: str) -> Response:
        authorization = self.authorizations.get(id)
        if authorization is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="authorization_id",
                                location="path")
        if authorization["status"] == "VOIDED":
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "PREVIOUSLY_VOIDED",
                                "Authorization has been previously voided and hence cannot be "
                                "voided again.")
        if authorization["status"] in ("CAPTURED", "PARTIALLY_CAPTURED"):
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "PREVIOUSLY_CAPTURED",
                                "Authorization has been previously captured and hence cannot be "
                                "voided.")
        authorization.update(status="VOIDED", update_time=_now())
        if request.header("Prefer") == "return=representation":
            return _json(200, self._representation(authorization))
        return Response(204)

    def _get_authorization(self, body: dict[str, Any], request: Request, id: str) -> Response:
        authorization = self.authorizations.get(id)
        if authorization is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="authorization_id",
                                location="path")
        return _json(200, {**self._representation(authorization),
                           "supplementary_data": {"related_ids": {"order_id": authorization["order_id"]}}})

    def _capture(self, body: dict[str, Any], request: Request, id: str) -> Response:
        authorization = self.authorizations.get(id)
        if authorization is None:
            return paypal_error(404, "RESOURCE_NOT_FOUND", "INVALID_RESOURCE_ID",
                                "Specified resource ID does not exist.", field="authorization_id",
                                location="path")
        if authorization["status"] == "VOIDED":
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "AUTHORIZATION_VOIDED",
                                "A voided authorization cannot be captured.")
        if authorization["status"] == "CAPTURED":
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "AUTHORIZATION_ALREADY_CAPTURED",
                                "Authorization has already been captured.")
        currency = authorization["amount"]["currency_code"]
        remaining = Decimal(authorization["amount"]["value"]) - authorization["captured"]
        value = remaining
        if "amount" in body:
            value = self._amount(body["amount"], "/amount")
            if body["amount"]["currency_code"] != currency:
                return paypal_error(422, "UNPROCESSABLE_ENTITY", "CURRENCY_MISMATCH",
                                    "Currency of capture must be the same as currency of "
                                    "authorization.", field="/amount/currency_code")
        if value <= 0 or value > remaining:
            return paypal_error(422, "UNPROCESSABLE_ENTITY", "MAX_CAPTURE_AMOUNT_EXCEEDED",
                                "Capture amount exceeds allowable limit.", field="/amount/value")
        authorization["captured"] += value
        final = bool(body.get("final_capture", False)) or value == remaining
        authorization.update(status="CAPTURED" if final else "PARTIALLY_CAPTURED",
                             update_time=_now())
        capture_id = self._new_capture(value, currency, authorization_id=id, order_id=authorization["order_id"],
                                       final_capture=final)
        return _json(201, self._representation(self.captures[capture_id]))

    def _verify(self, body: dict[str, Any], request: Request) -> Response:
        fields = ("auth_algo", "cert_url", "transmission_id", "transmission_sig",
                  "transmission_time", "webhook_id", "webhook_event")
        for field in fields:
            if not body.get(field):
                return paypal_error(400, "VALIDATION_ERROR", "MISSING_REQUIRED_PARAMETER",
                                    f"{field} is required.", field=f"/{field}")
        try:
            sent = datetime.strptime(body["transmission_time"], "%Y-%m-%dT%H:%M:%SZ").replace(
                tzinfo=timezone.utc)
        except ValueError:
            sent = None
        genuine = (
            body["auth_algo"] == "SHA256withRSA"
            and body["cert_url"].startswith(("https://api.paypal.com/", "https://api.sandbox.paypal.com/"))
            and sent is not None
            and abs(datetime.now(timezone.utc) - sent) <= self.webhook_max_age
            and hmac.compare_digest(body["transmission_sig"], self._signature(
                body["transmission_id"], body["transmission_time"], body["webhook_id"],
                body["webhook_event"]))
        )
        return _json(200, {"verification_status": "SUCCESS" if genuine else "FAILURE"})

    # -- helpers ---------------------------------------------------------------------------------
    def _amount(self, amount: Any, field: str) -> Decimal:
        """Check an amount the way PayPal does; its value as a Decimal."""
        if not isinstance(amount, dict) or not amount.get("currency_code") or not amount.get("value"):
            raise _Problem(paypal_error(400, "INVALID_REQUEST", "MISSING_REQUIRED_PARAMETER",
                                        "A required field is missing.", field=field))
        currency, value = amount["currency_code"], str(amount["value"])
        if not VALUE.match(value):
            raise _Problem(paypal_error(400, "INVALID_REQUEST", "INVALID_PARAMETER_SYNTAX",
                                        "The value of a field does not conform to the expected "
                                        "format.", field=f"{field}/value"))
        if currency not in CURRENCIES:
            raise _Problem(paypal_error(422, "UNPROCESSABLE_ENTITY", "CURRENCY_NOT_SUPPORTED",
                                        "Currency code is not currently supported.",
                                        field=f"{field}/currency_code"))
        decimals = len(value.partition(".")[2])
        if currency in NO_DECIMALS and decimals:
            raise _Problem(paypal_error(400, "INVALID_REQUEST", "DECIMALS_NOT_SUPPORTED",
                                        "Currency does not support decimals.",
                                        field=f"{field}/value"))
        if decimals > 2:
            raise _Problem(paypal_error(400, "INVALID_REQUEST", "DECIMAL_PRECISION",
                                        "If the currency supports decimals, only two decimal "
                                        "place precision is supported.", field=f"{field}/value"))
        return Decimal(value)

    def _new_order(self, intent: str, value: Decimal, currency: str) -> str:
        order_id = _new_id()
        self.orders[order_id] = {
            "id": order_id, "intent": intent, "status": "COMPLETED", "create_time": _now(),
            "update_time": _now(),
            "purchase_units": [{"reference_id": "default", "amount": _money(value, currency)}],
            "links": [{"href": f"{self.url}/v2/checkout/orders/{order_id}", "rel": "self", "method": "GET"}],
        }
        return order_id

    def _new_capture(self, value: Decimal, currency: str, *, authorization_id: str | None,
                     order_id: str | None, final_capture: bool = True) -> str:
        capture_id = _new_id()
        related = {"order_id": order_id, "authorization_id": authorization_id}
        up = (f"{self.url}/v2/payments/authorizations/{authorization_id}" if authorization_id
              else f"{self.url}/v2/checkout/orders/{order_id}" if order_id else None)
        self.captures[capture_id] = {
            "id": capture_id, "status": "COMPLETED", "amount": _money(value, currency),
            "final_capture": final_capture, "refunded": Decimal(0),
            "authorization_id": authorization_id, "order_id": order_id,
            "supplementary_data": {"related_ids": {k: v for k, v in related.items() if v}} if order_id else None,
            "links": [{"href": f"{self.url}/v2/payments/captures/{capture_id}", "rel": "self", "method": "GET"},
                      {"href": f"{self.url}/v2/payments/captures/{capture_id}/refund", "rel": "refund",
                       "method": "POST"},
                      *([{"href": up, "rel": "up", "method": "GET"}] if up else [])],
            "seller_protection": {"status": "ELIGIBLE",
                                  "dispute_categories": ["ITEM_NOT_RECEIVED",
                                                         "UNAUTHORIZED_TRANSACTION"]},
            "create_time": _now(), "update_time": _now(),
        }
        return capture_id

    @staticmethod
    def _representation(resource: dict[str, Any]) -> dict[str, Any]:
        """The resource as PayPal shows it: without the fake's own bookkeeping."""
        private = {"refunded", "captured", "capture_id", "authorization_id", "order_id", "payer"}
        return {key: value for key, value in resource.items()
                if key not in private and value is not None}

    def _signature(self, transmission_id: str, when: str, webhook_id: str, event: Any) -> str:
        message = f"{transmission_id}|{when}|{webhook_id}|{zlib.crc32(_canonical(event))}"
        return base64.b64encode(hmac.new(self._signing_key, message.encode(),
                                         hashlib.sha256).digest()).decode()

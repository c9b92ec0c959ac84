"""An SQS double as strict as AWS: moto's SQS server with AWS's refusals in front of it.

moto accepts what SQS refuses (characters outside the XML set in bodies and attribute
values, more than 10 message attributes, messages over the queue's size counted in
characters rather than bytes, a receipt handle of an earlier receive) and so let the
library rely on leniency that production would not give it. Every moto server the test
suites, the chaos run and the benchmarks start runs this module instead
(``python -m tests.strict_sqs -H 127.0.0.1 -p PORT``): moto's own WSGI application,
wrapped by :class:`StrictSqs`, in moto's process (no extra network hop, no extra
process on a 2-core machine). Each request is read once; only the refusals below cost
anything beyond that, and a request that breaks no rule reaches moto unchanged.

What it refuses, as the Amazon SQS API Reference documents it (codes and shapes as AWS
returns them, for both protocols boto3 may speak: JSON with ``X-Amz-Target:
AmazonSQS.<Action>``, and the query protocol with form-encoded ``Action=...``):

==========================================  ==============================================
input                                       answer
==========================================  ==============================================
body with a character outside ``#x9 #xA     SendMessage: 400 ``InvalidMessageContents``;
#xD #x20-#xD7FF #xE000-#xFFFD               SendMessageBatch: that entry in ``Failed``
#x10000-#x10FFFF``                          (``SenderFault`` true), the others sent
String attribute value with such a          ``InvalidParameterValue`` (same placement)
character, or an empty one
more than 10 message attributes             ``InvalidParameterValue`` (same placement)
``DelaySeconds`` above 900                  ``InvalidParameterValue`` (same placement)
message (body + attribute names, types      SendMessage: ``InvalidParameterValue``
and values, UTF-8 bytes) over the queue's
``MaximumMessageSize``
batch whose messages together exceed the    SendMessageBatch: 400 ``BatchRequestTooLong``
queue's ``MaximumMessageSize``              (the whole call)
more than 10 entries in a batch             400 ``TooManyEntriesInBatchRequest``
DeleteMessage with the handle of an         200, and nothing is deleted (DeleteMessage:
earlier receive of a message received       "otherwise, the request succeeds, but the
again since                                 message will not be deleted")
ChangeMessageVisibility with such a         400 ``InvalidParameterValue`` ("Message does
handle                                      not exist or is not available for visibility
                                            timeout change"); batch: that entry fails
ChangeMessageVisibility whose new           400 ``InvalidParameterValue`` ("Total
visibility would end more than 43,200 s     VisibilityTimeout for the message is beyond
after the message's first receive           the limit [43200 seconds]"); batch: that
(a timeout of 0 is always allowed)          entry fails
==========================================  ==============================================

The batch total is checked against the queue's ``MaximumMessageSize``, the stricter of the
two documented readings (SQS documents one limit for a message and for a batch's sum).
The 12-hour ceiling is counted from the message's *first* receive, the stricter reading of
"12 hours from the time that Amazon SQS receives the ReceiveMessage request"; code that is
right here is right under both.

Test hooks:

* ``POST /strict-sqs/first-receive`` with ``{"message_id": ..., "epoch_seconds": ...}``
  moves a received message's first receive back in time (and
  ``ApproximateFirstReceiveTimestamp`` in later receives with it), so the 12-hour ceiling
  can be tested without waiting 12 hours;
* ``POST /strict-sqs/refuse`` with ``{"marker": ..., "code": ..., "message": ...,
  "sender_fault": true|false}`` makes every message whose body contains ``marker`` fail as
  SQS fails an entry it does not take (in ``Failed`` with that code and ``SenderFault``; a
  SendMessage gets the error), until ``{"marker": ..., "clear": true}``.

* ``POST /strict-sqs/deny`` with ``{"action": "SendMessageBatch", "queue": ..., "code":
  "AccessDenied", "message": ...}`` fails every call of that action on queues whose URL
  contains ``queue`` as a whole (HTTP 403, as an IAM or KMS denial does), until
  ``{"action": ..., "queue": ..., "clear": true}``.

``POST /moto-api/reset`` also forgets this layer's state.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode

MAX_ENTRIES = 10
MAX_ATTRIBUTES = 10
MAX_DELAY_SECONDS = 900
MAX_VISIBILITY_SECONDS = 43_200
DEFAULT_MAX_MESSAGE_BYTES = 262_144

XMLNS = "http://queue.amazonaws.com/doc/2012-11-05/"
ALLOWED = "#x9 | #xA | #xD | #x20 to #xD7FF | #xE000 to #xFFFD | #x10000 to #x10FFFF"
_REFUSED = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_BATCH_PREFIX = {
    "SendMessageBatch": "SendMessageBatchRequestEntry",
    "DeleteMessageBatch": "DeleteMessageBatchRequestEntry",
    "ChangeMessageVisibilityBatch": "ChangeMessageVisibilityBatchRequestEntry",
}
_SUCCESS_ELEMENT = {
    "SendMessageBatch": "SendMessageBatchResultEntry",
    "DeleteMessageBatch": "DeleteMessageBatchResultEntry",
    "ChangeMessageVisibilityBatch": "ChangeMessageVisibilityBatchResultEntry",
}


class Refusal(Exception):
    """An AWS error: HTTP 400 with ``code`` and ``message`` (sender fault unless said)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.sender_fault = True


def _bad_character(text: str) -> str | None:
    match = _REFUSED.search(text)
    return None if match is None else f"#x{ord(match.group()):X}"


# --- requests in both protocols ---------------------------------------------------------------
@dataclasses.dataclass
class Request:
    """One SQS call, normalised: ``params`` as the JSON protocol spells them."""

    protocol: str  # "json" or "query"
    action: str
    params: dict[str, Any]
    raw_form: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _query_attributes(form: dict[str, str], prefix: str) -> dict[str, dict[str, str]]:
    """``MessageAttribute.N.Name`` / ``.Value.DataType`` / ``.Value.StringValue`` under ``prefix``."""
    attributes: dict[str, dict[str, str]] = {}
    index = 1
    while f"{prefix}MessageAttribute.{index}.Name" in form:
        base = f"{prefix}MessageAttribute.{index}"
        value: dict[str, str] = {"DataType": form.get(f"{base}.Value.DataType", "")}
        for field in ("StringValue", "BinaryValue"):
            if f"{base}.Value.{field}" in form:
                value[field] = form[f"{base}.Value.{field}"]
        attributes[form[f"{base}.Name"]] = value
        index += 1
    return attributes


def _query_entries(form: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    entries = []
    index = 1
    while f"{prefix}.{index}.Id" in form:
        base = f"{prefix}.{index}."
        entry: dict[str, Any] = {
            key[len(base) :]: value
            for key, value in form.items()
            if key.startswith(base) and "MessageAttribute." not in key
        }
        entry["MessageAttributes"] = _query_attributes(form, base)
        entries.append(entry)
        index += 1
    return entries


def parse_request(environ: dict[str, Any], body: bytes) -> Request | None:
    """The SQS call in this request, or None when it is not one (moto's own API, ...)."""
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    if target.startswith("AmazonSQS."):
        try:
            params = json.loads(body or b"{}")
        except ValueError:
            return None
        return Request("json", target.removeprefix("AmazonSQS."), params if isinstance(params, dict) else {})
    if (
        "x-www-form-urlencoded" not in environ.get("CONTENT_TYPE", "")
        or environ.get("REQUEST_METHOD") != "POST"
    ):
        return None
    pairs = parse_qsl(body.decode("utf-8", "surrogatepass"), keep_blank_values=True)
    form = dict(pairs)
    action = form.get("Action")
    if not action:
        return None
    params: dict[str, Any] = {k: v for k, v in form.items() if "." not in k}
    if action in _BATCH_PREFIX:
        params["Entries"] = _query_entries(form, _BATCH_PREFIX[action])
    elif action == "SendMessage":
        params["MessageAttributes"] = _query_attributes(form, "")
    return Request("query", action, params, pairs)


def rewrite_entries(request: Request, entries: list[dict[str, Any]], environ: dict[str, Any]) -> bytes:
    """The request body with only ``entries`` kept (renumbered in the query protocol)."""
    if request.protocol == "json":
        return json.dumps({**request.params, "Entries": entries}).encode("utf-8")
    prefix = _BATCH_PREFIX[request.action]
    kept_ids = [entry["Id"] for entry in entries]
    form = dict(request.raw_form)
    old_index = {form[f"{prefix}.{i}.Id"]: i for i in range(1, len(form) + 1) if f"{prefix}.{i}.Id" in form}
    pairs = [(k, v) for k, v in request.raw_form if not k.startswith(prefix + ".")]
    for new, entry_id in enumerate(kept_ids, start=1):
        old = f"{prefix}.{old_index[entry_id]}."
        pairs += [(f"{prefix}.{new}.{k[len(old) :]}", v) for k, v in request.raw_form if k.startswith(old)]
    return urlencode(pairs).encode("utf-8")


# --- responses in both protocols --------------------------------------------------------------
def error_response(protocol: str, refusal: Refusal) -> tuple[str, list[tuple[str, str]], bytes]:
    request_id = str(uuid.uuid4())
    if protocol == "json":
        body = json.dumps({"__type": f"com.amazonaws.sqs#{refusal.code}", "message": refusal.message})
        headers = [
            ("Content-Type", "application/x-amz-json-1.0"),
            ("x-amzn-query-error", f"{refusal.code};Sender"),
            ("x-amzn-RequestId", request_id),
        ]
        return "400 Bad Request", headers, body.encode("utf-8")
    root = ET.Element("ErrorResponse", xmlns=XMLNS)
    error = ET.SubElement(root, "Error")
    ET.SubElement(error, "Type").text = "Sender"
    ET.SubElement(error, "Code").text = refusal.code
    ET.SubElement(error, "Message").text = refusal.message
    ET.SubElement(error, "Detail")
    ET.SubElement(root, "RequestId").text = request_id
    return (
        "400 Bad Request",
        [("Content-Type", "text/xml"), ("x-amzn-RequestId", request_id)],
        ET.tostring(root),
    )


def empty_response(protocol: str, action: str) -> tuple[str, list[tuple[str, str]], bytes]:
    """A successful answer with no result (DeleteMessage)."""
    request_id = str(uuid.uuid4())
    if protocol == "json":
        return "200 OK", [("Content-Type", "application/x-amz-json-1.0")], b"{}"
    root = ET.Element(f"{action}Response", xmlns=XMLNS)
    metadata = ET.SubElement(root, "ResponseMetadata")
    ET.SubElement(metadata, "RequestId").text = request_id
    return "200 OK", [("Content-Type", "text/xml")], ET.tostring(root)


def _strip(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def batch_result(protocol: str, action: str, body: bytes | None) -> dict[str, Any]:
    """``{"Successful": [...], "Failed": [...]}`` of a batch answer (None: an empty one)."""
    if body is None:
        return {"Successful": [], "Failed": []}
    if protocol == "json":
        document = json.loads(body)
        return {"Successful": document.get("Successful", []), "Failed": document.get("Failed", [])}
    result: dict[str, Any] = {"Successful": [], "Failed": []}
    for element in ET.fromstring(body).iter():
        name = _strip(element.tag)
        if name == _SUCCESS_ELEMENT[action]:
            result["Successful"].append({_strip(child.tag): child.text or "" for child in element})
        elif name == "BatchResultErrorEntry":
            entry: dict[str, Any] = {_strip(child.tag): child.text or "" for child in element}
            entry["SenderFault"] = entry.get("SenderFault") == "true"
            result["Failed"].append(entry)
    return result


def render_batch(protocol: str, action: str, result: dict[str, Any]) -> bytes:
    if protocol == "json":
        return json.dumps({"Successful": result["Successful"], "Failed": result["Failed"]}).encode("utf-8")
    root = ET.Element(f"{action}Response", xmlns=XMLNS)
    body = ET.SubElement(root, f"{action}Result")
    for entry in result["Successful"]:
        element = ET.SubElement(body, _SUCCESS_ELEMENT[action])
        for key, value in entry.items():
            ET.SubElement(element, key).text = str(value)
    for entry in result["Failed"]:
        element = ET.SubElement(body, "BatchResultErrorEntry")
        for key in ("Id", "SenderFault", "Code", "Message"):
            value = entry.get(key)
            ET.SubElement(element, key).text = str(value).lower() if key == "SenderFault" else str(value)
    metadata = ET.SubElement(root, "ResponseMetadata")
    ET.SubElement(metadata, "RequestId").text = str(uuid.uuid4())
    return ET.tostring(root)


# --- the rules ---------------------------------------------------------------------------------
def message_size(body: str, attributes: dict[str, dict[str, str]]) -> int:
    """Bytes as SQS counts them: UTF-8 body plus each attribute's name, type and value."""
    size = len(body.encode("utf-8", "surrogatepass"))
    for name, value in attributes.items():
        size += len(name.encode("utf-8", "surrogatepass")) + len(value.get("DataType", "").encode("utf-8"))
        if "StringValue" in value:
            size += len(str(value["StringValue"]).encode("utf-8", "surrogatepass"))
        elif "BinaryValue" in value:
            size += len(str(value["BinaryValue"]))
    return size


def check_message(entry: dict[str, Any]) -> None:
    """Raise the :class:`Refusal` SQS gives one message (body, attributes, delay)."""
    body = str(entry.get("MessageBody", ""))
    bad = _bad_character(body)
    if bad:
        raise Refusal(
            "InvalidMessageContents",
            f"Invalid binary character '{bad}' was found in the message body, the set of allowed "
            f"characters is {ALLOWED}",
        )
    attributes = entry.get("MessageAttributes") or {}
    if len(attributes) > MAX_ATTRIBUTES:
        raise Refusal(
            "InvalidParameterValue",
            f"Number of message attributes [{len(attributes)}] exceeds the allowed maximum "
            f"[{MAX_ATTRIBUTES}].",
        )
    for name, value in attributes.items():
        kind = str(value.get("DataType", ""))
        if kind.startswith("String") or kind.startswith("Number"):
            text = value.get("StringValue")
            if not isinstance(text, str) or text == "":
                raise Refusal(
                    "InvalidParameterValue",
                    f"Message (user) attribute '{name}' must contain a non-empty value of type '{kind}'.",
                )
            bad = _bad_character(text)
            if bad:
                raise Refusal(
                    "InvalidParameterValue",
                    f"Message (user) attribute '{name}' value contains invalid binary character '{bad}'. "
                    f"You must use only the following supported characters: {ALLOWED}.",
                )
            if kind.startswith("Number") and _NUMBER.match(text) is None:
                raise Refusal(
                    "InvalidParameterValue",
                    f"Can't cast the value of message (user) attribute '{name}' to a number.",
                )
    delay = entry.get("DelaySeconds")
    if delay not in (None, "") and not 0 <= int(delay) <= MAX_DELAY_SECONDS:
        raise Refusal(
            "InvalidParameterValue",
            f"Value {delay} for parameter DelaySeconds is invalid. Reason: must be between 0 and "
            f"{MAX_DELAY_SECONDS}, if provided.",
        )


@dataclasses.dataclass
class _Receipt:
    message_id: str
    queue: str


class StrictSqs:
    """WSGI middleware applying AWS's refusals before moto sees a request.

    Args:
        app: moto's WSGI application.
        max_message_bytes: ``MaximumMessageSize`` of a queue when it cannot be read.
        clock: Wall clock (seconds since the epoch).
    """

    def __init__(
        self,
        app: Callable[..., Iterable[bytes]],
        *,
        max_message_bytes: Callable[[str, str], int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        self.clock = clock
        self._max_message_bytes = max_message_bytes or _moto_max_message_bytes
        self._lock = threading.Lock()
        self._receipts: dict[str, _Receipt] = {}  # handle -> message
        self._latest: dict[str, str] = {}  # message id -> its latest receipt handle
        self._first_receive: dict[str, float] = {}  # message id -> epoch seconds
        self._backdated: set[str] = set()
        self._refusals: dict[str, Refusal] = {}  # body marker -> the entry failure to answer
        self._denials: dict[tuple[str, str], Refusal] = {}  # (action, queue) -> whole-call failure

    # --- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self._receipts.clear()
            self._latest.clear()
            self._first_receive.clear()
            self._backdated.clear()
            self._refusals.clear()
            self._denials.clear()

    def refusal_for(self, body: str) -> Refusal | None:
        """The refusal a test asked for (``/strict-sqs/refuse``) for a message with this body."""
        with self._lock:
            for marker, refusal in self._refusals.items():
                if marker in body:
                    return refusal
        return None

    def is_stale(self, handle: str) -> bool:
        """True when ``handle`` is not the latest receipt handle of its message."""
        with self._lock:
            receipt = self._receipts.get(handle)
            return receipt is not None and self._latest.get(receipt.message_id) != handle

    def first_receive(self, handle: str) -> float | None:
        with self._lock:
            receipt = self._receipts.get(handle)
            return None if receipt is None else self._first_receive.get(receipt.message_id)

    def forget(self, handle: str) -> None:
        """The message was deleted through its latest handle: drop what is known of it."""
        with self._lock:
            receipt = self._receipts.get(handle)
            if receipt is None or self._latest.get(receipt.message_id) != handle:
                return
            for other in [h for h, r in self._receipts.items() if r.message_id == receipt.message_id]:
                del self._receipts[other]
            self._latest.pop(receipt.message_id, None)
            self._first_receive.pop(receipt.message_id, None)
            self._backdated.discard(receipt.message_id)

    def record_receive(self, queue: str, messages: list[dict[str, Any]]) -> bool:
        """Remember each received message's new handle; True when an answer must change
        (a backdated first receive to report)."""
        now = self.clock()
        changed = False
        with self._lock:
            for message in messages:
                message_id, handle = message.get("MessageId"), message.get("ReceiptHandle")
                if not message_id or not handle:
                    continue
                self._receipts[handle] = _Receipt(message_id, queue)
                self._latest[message_id] = handle
                self._first_receive.setdefault(message_id, now)
                if message_id in self._backdated:
                    attributes = message.setdefault("Attributes", {})
                    if "ApproximateFirstReceiveTimestamp" in attributes:
                        attributes["ApproximateFirstReceiveTimestamp"] = str(
                            int(self._first_receive[message_id] * 1000)
                        )
                        changed = True
        return changed

    def check_visibility(self, handle: str, timeout: Any) -> None:
        """Refuse a visibility change SQS refuses: a stale handle, or past the 12-hour ceiling."""
        if self.is_stale(handle):
            raise Refusal(
                "InvalidParameterValue",
                f"Value {handle} for parameter ReceiptHandle is invalid. Reason: Message does not exist "
                "or is not available for visibility timeout change.",
            )
        seconds = int(timeout)
        first = self.first_receive(handle)
        if seconds > MAX_VISIBILITY_SECONDS or (
            seconds > 0 and first is not None and self.clock() + seconds - first > MAX_VISIBILITY_SECONDS
        ):
            raise Refusal(
                "InvalidParameterValue",
                f"Value {seconds} for parameter VisibilityTimeout is invalid. Reason: "
                "Total VisibilityTimeout "
                f"for the message is beyond the limit [{MAX_VISIBILITY_SECONDS} seconds]",
            )

    # --- WSGI ------------------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/moto-api/reset":
            self.reset()
            return self.app(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        if path == "/strict-sqs/first-receive":
            return self._backdate(body, start_response)
        if path == "/strict-sqs/refuse":
            return self._set_refusal(body, start_response)
        if path == "/strict-sqs/deny":
            return self._set_denial(body, start_response)
        request = parse_request(environ, body)
        if request is None:
            return self._forward(environ, body, start_response)
        try:
            self._check_denied(request, environ)
            return self._handle(request, environ, body, start_response)
        except Refusal as refusal:
            status, headers, content = error_response(request.protocol, refusal)
            if refusal.code == "AccessDenied":
                status = "403 Forbidden"
            return _respond(start_response, status, headers, content)

    def _check_denied(self, request: Request, environ: dict[str, Any]) -> None:
        with self._lock:
            if not self._denials:
                return
            url = str(request.params.get("QueueUrl") or environ.get("PATH_INFO", ""))
            for (action, queue), refusal in self._denials.items():
                if action == request.action and url.rstrip("/").endswith(queue):
                    raise refusal

    def _set_denial(self, body: bytes, start_response: Callable[..., Any]) -> Iterable[bytes]:
        document = json.loads(body)
        key = (str(document["action"]), str(document["queue"]))
        with self._lock:
            if document.get("clear"):
                self._denials.pop(key, None)
            else:
                self._denials[key] = Refusal(
                    str(document.get("code") or "AccessDenied"),
                    str(document.get("message") or "denied by the test"),
                )
        return _respond(start_response, "200 OK", [("Content-Type", "application/json")], b"{}")

    def _backdate(self, body: bytes, start_response: Callable[..., Any]) -> Iterable[bytes]:
        document = json.loads(body)
        with self._lock:
            self._first_receive[str(document["message_id"])] = float(document["epoch_seconds"])
            self._backdated.add(str(document["message_id"]))
        return _respond(start_response, "200 OK", [("Content-Type", "application/json")], b"{}")

    def _set_refusal(self, body: bytes, start_response: Callable[..., Any]) -> Iterable[bytes]:
        document = json.loads(body)
        with self._lock:
            if document.get("clear"):
                self._refusals.pop(str(document["marker"]), None)
            else:
                refusal = Refusal(
                    str(document["code"]), str(document.get("message") or "refused by the test")
                )
                refusal.sender_fault = bool(document.get("sender_fault", True))
                self._refusals[str(document["marker"])] = refusal
        return _respond(start_response, "200 OK", [("Content-Type", "application/json")], b"{}")

    def _forward(
        self, environ: dict[str, Any], body: bytes, start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        return self.app(environ, start_response)

    def _call(self, environ: dict[str, Any], body: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        """Run moto on ``body``; return its status, headers and body."""
        captured: dict[str, Any] = {}

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            captured["status"], captured["headers"] = status, headers
            return lambda data: None

        environ = dict(environ)
        chunks = self._forward(environ, body, capture)
        try:
            content = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        headers = [(k, v) for k, v in captured["headers"] if k.lower() != "content-length"]
        return captured["status"], headers, content

    def _handle(
        self, request: Request, environ: dict[str, Any], body: bytes, start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        action, params = request.action, request.params
        if action == "SendMessage":
            check_message(params)
            asked = self.refusal_for(str(params.get("MessageBody", "")))
            if asked is not None:
                raise asked
            limit = self._queue_limit(environ, params)
            size = message_size(str(params.get("MessageBody", "")), params.get("MessageAttributes") or {})
            if size > limit:
                raise Refusal(
                    "InvalidParameterValue",
                    "One or more parameters are invalid. Reason: Message must be shorter than "
                    f"{limit} bytes.",
                )
            return self._forward(environ, body, start_response)
        if action in _BATCH_PREFIX:
            entries = list(params.get("Entries") or [])
            if len(entries) > MAX_ENTRIES:
                raise Refusal(
                    "TooManyEntriesInBatchRequest",
                    f"Maximum number of entries per request are {MAX_ENTRIES}. You have sent {len(entries)}.",
                )
            return self._batch(request, entries, environ, body, start_response)
        if action == "DeleteMessage":
            handle = str(params.get("ReceiptHandle", ""))
            if self.is_stale(handle):  # AWS: the request succeeds, the message is not deleted
                return _respond(start_response, *empty_response(request.protocol, action))
            status, headers, content = self._call(environ, body)
            if status.startswith("200"):
                self.forget(handle)
            return _respond(start_response, status, headers, content)
        if action == "ChangeMessageVisibility":
            self.check_visibility(str(params.get("ReceiptHandle", "")), params.get("VisibilityTimeout", 0))
            return self._forward(environ, body, start_response)
        if action == "ReceiveMessage":
            return self._receive(request, environ, body, start_response)
        return self._forward(environ, body, start_response)

    def _batch(
        self,
        request: Request,
        entries: list[dict[str, Any]],
        environ: dict[str, Any],
        body: bytes,
        start_response: Callable[..., Any],
    ) -> Iterable[bytes]:
        action = request.action
        failed: list[dict[str, Any]] = []
        succeeded: list[dict[str, Any]] = []
        forward: list[dict[str, Any]] = []
        if action == "SendMessageBatch" and entries:
            limit = self._queue_limit(environ, request.params)
            total = sum(
                message_size(str(e.get("MessageBody", "")), e.get("MessageAttributes") or {}) for e in entries
            )
            if total > limit:
                raise Refusal(
                    "BatchRequestTooLong",
                    f"Batch requests cannot be longer than {limit} bytes. You have sent {total} bytes.",
                )
        for entry in entries:
            try:
                if action == "SendMessageBatch":
                    check_message(entry)
                    asked = self.refusal_for(str(entry.get("MessageBody", "")))
                    if asked is not None:
                        raise asked
                elif action == "ChangeMessageVisibilityBatch":
                    self.check_visibility(
                        str(entry.get("ReceiptHandle", "")), entry.get("VisibilityTimeout", 0)
                    )
                elif action == "DeleteMessageBatch" and self.is_stale(str(entry.get("ReceiptHandle", ""))):
                    succeeded.append({"Id": entry["Id"]})  # succeeds, deletes nothing
                    continue
            except Refusal as refusal:
                failed.append(
                    {
                        "Id": entry["Id"],
                        "SenderFault": refusal.sender_fault,
                        "Code": refusal.code,
                        "Message": refusal.message,
                    }
                )
                continue
            forward.append(entry)
        if not failed and not succeeded:
            if action != "DeleteMessageBatch":
                return self._forward(environ, body, start_response)
            status, headers, content = self._call(environ, body)
            if status.startswith("200"):
                self._forget_deleted(request.protocol, action, content, forward)
            return _respond(start_response, status, headers, content)
        result = batch_result(request.protocol, action, None)
        headers = [
            ("Content-Type", "application/x-amz-json-1.0" if request.protocol == "json" else "text/xml")
        ]
        if forward:
            status, headers, content = self._call(environ, rewrite_entries(request, forward, environ))
            if not status.startswith("200"):
                return _respond(start_response, status, headers, content)
            result = batch_result(request.protocol, action, content)
            if action == "DeleteMessageBatch":
                self._forget_deleted(request.protocol, action, content, forward)
        result["Successful"] += succeeded
        result["Failed"] += failed
        return _respond(start_response, "200 OK", headers, render_batch(request.protocol, action, result))

    def _forget_deleted(
        self, protocol: str, action: str, content: bytes, entries: list[dict[str, Any]]
    ) -> None:
        done = {entry.get("Id") for entry in batch_result(protocol, action, content)["Successful"]}
        for entry in entries:
            if entry.get("Id") in done:
                self.forget(str(entry.get("ReceiptHandle", "")))

    def _receive(
        self, request: Request, environ: dict[str, Any], body: bytes, start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        status, headers, content = self._call(environ, body)
        if not status.startswith("200"):
            return _respond(start_response, status, headers, content)
        queue = str(request.params.get("QueueUrl", ""))
        if request.protocol == "json":
            document = json.loads(content or b"{}")
            if self.record_receive(queue, document.get("Messages", [])):
                content = json.dumps(document).encode("utf-8")
            return _respond(start_response, status, headers, content)
        root = ET.fromstring(content)
        messages = []
        for element in root.iter():
            if _strip(element.tag) != "Message":
                continue
            fields = {_strip(child.tag): child for child in element}
            attributes = {}
            for attribute in element:
                if _strip(attribute.tag) == "Attribute":
                    parts = {_strip(child.tag): child for child in attribute}
                    if "Name" in parts and "Value" in parts:
                        attributes[parts["Name"].text] = parts["Value"]
            messages.append(
                {
                    "MessageId": fields["MessageId"].text if "MessageId" in fields else None,
                    "ReceiptHandle": fields["ReceiptHandle"].text if "ReceiptHandle" in fields else None,
                    "Attributes": {k: v.text for k, v in attributes.items()},
                    "_elements": attributes,
                }
            )
        if self.record_receive(queue, messages):
            for message in messages:
                stamp = message["_elements"].get("ApproximateFirstReceiveTimestamp")
                if stamp is not None:
                    stamp.text = message["Attributes"]["ApproximateFirstReceiveTimestamp"]
            ET.register_namespace("", XMLNS)
            content = ET.tostring(root)
        return _respond(start_response, status, headers, content)

    def _queue_limit(self, environ: dict[str, Any], params: dict[str, Any]) -> int:
        url = str(params.get("QueueUrl") or environ.get("PATH_INFO", ""))
        parts = [p for p in url.split("/") if p]
        name = parts[-1] if parts else ""
        account = parts[-2] if len(parts) >= 2 and parts[-2].isdigit() else "123456789012"
        region = _region(environ)
        try:
            return self._max_message_bytes(f"{account}/{region}", name)
        except Exception:
            return DEFAULT_MAX_MESSAGE_BYTES


def _region(environ: dict[str, Any]) -> str:
    match = re.search(r"Credential=[^/]+/\d+/([^/]+)/", environ.get("HTTP_AUTHORIZATION", ""))
    return match.group(1) if match else "us-east-1"


def _moto_max_message_bytes(account_region: str, queue_name: str) -> int:
    from moto.sqs.models import sqs_backends

    account, region = account_region.split("/")
    return int(sqs_backends[account][region].get_queue(queue_name).maximum_message_size)


def _respond(
    start_response: Callable[..., Any], status: str, headers: list[tuple[str, str]], content: bytes
) -> Iterable[bytes]:
    headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
    start_response(status, [*headers, ("Content-Length", str(len(content)))])
    return [content]


def main(argv: list[str] | None = None) -> None:
    """Serve moto's SQS behind :class:`StrictSqs` (same ``-H``/``-p`` options as moto)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import signal

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    from sqla_outbox.moto_server import patch_moto

    patch_moto()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(
        args.host,
        args.port,
        StrictSqs(app),
        threaded=True,
        use_reloader=False,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    main()

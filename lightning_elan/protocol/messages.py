"""The AM wire protocol's framing and validation: one UTF-8 JSON frame per request and per reply (pure, no sockets).

The body schemas, message types and version live in :mod:`lightning_elan.protocol.contract`; this module checks
frames and bodies against them.

Request: ``{"v": 1, "id": ID, "job": NAME, "type": TYPE, "body": {...}}``.
Reply: ``{"v": 1, "id": ID, "ok": true, "body": {...}}`` or ``{"v": 1, "id": ID|null, "ok": false, "error": MSG}``.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from lightning_elan.protocol.contract import BODY_SCHEMAS, MESSAGE_TYPES, PROTOCOL_VERSION, Field, ProtocolError

MAX_MESSAGE_BYTES = 1 << 20
MAX_ID_LENGTH = 200
MAX_NESTING = 32  # deepest JSON nesting accepted in a frame (no body needs more than a handful of levels)


@dataclass(frozen=True)
class Request:
    """A decoded, validated request."""

    id: str
    job: str
    type: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """A decoded reply: ``body`` when ``ok``, else ``error``."""

    id: str | None
    ok: bool
    body: dict[str, Any]
    error: str | None = None


def new_message_id() -> str:
    """A fresh, globally unique request id."""
    return uuid.uuid4().hex


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _matches(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # bool is an int subclass; JSON true/false is never a number here
        return bool in types
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, types)


def validate_body(msg_type: str, body: Any, msg_id: str | None = None) -> None:
    """Raise ``ProtocolError`` unless ``body`` fits the schema of ``msg_type`` (unknown extra keys are allowed)."""
    if msg_type not in BODY_SCHEMAS:
        raise ProtocolError(f"unknown message type {msg_type!r} (expected one of {sorted(MESSAGE_TYPES)})", msg_id)
    if not isinstance(body, dict):
        raise ProtocolError(f"{msg_type}: body must be an object, got {_type_name(body)}", msg_id)
    _validate_fields(msg_type, BODY_SCHEMAS[msg_type], body, msg_id)


def _validate_fields(where: str, schema: dict[str, Field], body: dict[str, Any], msg_id: str | None) -> None:
    for name, spec in schema.items():
        value = body.get(name)
        if value is None:
            if spec.required:
                raise ProtocolError(f"{where}: missing field {name!r}", msg_id)
            continue
        if not _matches(value, spec.types):
            expected = " or ".join(t.__name__ for t in spec.types)
            raise ProtocolError(f"{where}: field {name!r} must be {expected}, got {_type_name(value)}", msg_id)
        if spec.item_type is not None and not all(_matches(item, (spec.item_type,)) for item in value):
            raise ProtocolError(f"{where}: field {name!r} must list {spec.item_type.__name__} values", msg_id)
        if spec.schema is not None:
            _validate_fields(f"{where}.{name}", spec.schema, value, msg_id)


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _loads(data: bytes, what: str) -> Any:
    """Parse one frame: size limit, UTF-8, strict JSON."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{what} of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ProtocolError(f"{what} is not UTF-8: {error}") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ProtocolError(f"{what} nests deeper than {MAX_NESTING} levels") from None
    except ValueError as error:
        raise ProtocolError(f"{what} is not valid JSON: {error}") from None
    if nesting_depth(value) > MAX_NESTING:
        raise ProtocolError(f"{what} nests deeper than {MAX_NESTING} levels")
    return value


def nesting_depth(value: Any) -> int:
    """How deeply JSON containers nest in ``value`` (a scalar is 0, ``[]`` is 1); iterative, so any depth is safe."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _read_id(message: dict[str, Any]) -> str | None:
    msg_id = message.get("id")
    if isinstance(msg_id, str) and 0 < len(msg_id) <= MAX_ID_LENGTH:
        return msg_id
    return None


def _check_version(message: dict[str, Any], msg_id: str | None) -> None:
    version = message.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})", msg_id)


def encode_request(msg_id: str, job: str, msg_type: str, body: dict[str, Any] | None = None) -> bytes:
    """Validate and serialise a request; raises ``ProtocolError`` for an invalid or oversized one."""
    body = {} if body is None else body
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= MAX_ID_LENGTH:
        raise ProtocolError(f"request id must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    validate_body(msg_type, body, msg_id)
    payload = _dumps({"v": PROTOCOL_VERSION, "id": msg_id, "job": job, "type": msg_type, "body": body})
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"request of {len(payload)} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes", msg_id)
    return payload


def decode_request(data: bytes, *, job: str | None = None) -> Request:
    """Parse and validate one request frame; with ``job`` set, a request for another job is refused."""
    message = _loads(data, "request")
    if not isinstance(message, dict):
        raise ProtocolError(f"request must be a JSON object, got {_type_name(message)}")
    msg_id = _read_id(message)
    if msg_id is None:
        raise ProtocolError(f"request needs an 'id': a non-empty string of at most {MAX_ID_LENGTH} characters")
    _check_version(message, msg_id)
    msg_job, msg_type, body = message.get("job"), message.get("type"), message.get("body")
    if not isinstance(msg_job, str):
        raise ProtocolError("request needs a 'job' string", msg_id)
    if job is not None and msg_job != job:
        raise ProtocolError(f"wrong job {msg_job!r}: this AM serves job {job!r}", msg_id)
    if not isinstance(msg_type, str):
        raise ProtocolError("request needs a 'type' string", msg_id)
    if body is None:
        raise ProtocolError(f"{msg_type}: request needs a 'body' object", msg_id)
    validate_body(msg_type, body, msg_id)
    return Request(id=msg_id, job=msg_job, type=msg_type, body=body)


def ok_reply(msg_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """A success reply as a JSON-ready dict."""
    return {"v": PROTOCOL_VERSION, "id": msg_id, "ok": True, "body": body}


def error_reply(msg_id: str | None, message: str) -> dict[str, Any]:
    """An error reply as a JSON-ready dict."""
    return {"v": PROTOCOL_VERSION, "id": msg_id, "ok": False, "error": message}


def encode_reply(reply: dict[str, Any]) -> bytes:
    """Serialise a reply; one that would exceed ``MAX_MESSAGE_BYTES`` becomes an error reply."""
    try:
        payload = _dumps(reply)
    except ValueError as error:  # NaN/infinity somewhere in the body
        return _dumps(error_reply(reply.get("id"), f"reply could not be encoded: {error}"))
    if len(payload) > MAX_MESSAGE_BYTES:
        message = f"reply of {len(payload)} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes"
        return _dumps(error_reply(reply.get("id"), message))
    return payload


def decode_reply(data: bytes) -> Reply:
    """Parse and validate one reply frame."""
    message = _loads(data, "reply")
    if not isinstance(message, dict):
        raise ProtocolError(f"reply must be a JSON object, got {_type_name(message)}")
    msg_id = _read_id(message)
    _check_version(message, msg_id)
    ok = message.get("ok")
    if ok is True:
        body = message.get("body")
        if not isinstance(body, dict):
            raise ProtocolError("ok reply needs a 'body' object", msg_id)
        return Reply(id=msg_id, ok=True, body=body)
    if ok is False:
        error = message.get("error")
        if not isinstance(error, str):
            raise ProtocolError("error reply needs an 'error' string", msg_id)
        return Reply(id=msg_id, ok=False, body={}, error=error)
    raise ProtocolError("reply needs 'ok': true or false", msg_id)


__all__ = [
    "MAX_ID_LENGTH",
    "MAX_MESSAGE_BYTES",
    "MAX_NESTING",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "Reply",
    "Request",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "error_reply",
    "nesting_depth",
    "new_message_id",
    "ok_reply",
    "validate_body",
]

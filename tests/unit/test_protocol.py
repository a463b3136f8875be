from __future__ import annotations

import json

import pytest

from lightning_elan.protocol.contract import AdjustmentReport
from lightning_elan.protocol.messages import (
    MAX_MESSAGE_BYTES,
    MAX_NESTING,
    ProtocolError,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    error_reply,
    nesting_depth,
    new_message_id,
    ok_reply,
)


def _raw(**fields: object) -> bytes:
    message = {"v": 1, "id": "m1", "job": "job", "type": "status", "body": {}, **fields}
    return json.dumps(message).encode()


def test_request_round_trip() -> None:
    payload = encode_request("m1", "job", "scale", {"action": "remove", "ranks": [0, 2], "at_step": 40})

    request = decode_request(payload, job="job")

    assert (request.id, request.job, request.type) == ("m1", "job", "scale")
    assert request.body == {"action": "remove", "ranks": [0, 2], "at_step": 40}


def test_message_ids_are_unique() -> None:
    assert len({new_message_id() for _ in range(1000)}) == 1000


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff\xfe\x00", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b'{"v": 1, "id": "m1", "x": NaN}', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b" " * (MAX_MESSAGE_BYTES + 1), "exceeds the limit"),
        (_raw(id=None), "needs an 'id'"),
        (_raw(v=2), "unsupported protocol version 2"),
        (_raw(v=True), "unsupported protocol version True"),
        (_raw(type="dance"), "unknown message type 'dance'"),
        (_raw(body=None), "needs a 'body' object"),
        (_raw(body=[]), "body must be an object"),
        (_raw(type="register", body={}), "missing field 'worker_id'"),
        (_raw(type="scale", body={"action": "add", "count": True}), "'count' must be int, got bool"),
        (_raw(type="scale", body={"action": "add", "count": 1.5}), "'count' must be int, got float"),
        (_raw(type="scale", body={"action": "remove", "ranks": ["0"]}), "'ranks' must list int"),
    ],
)
def test_invalid_requests_are_refused_with_a_clear_message(payload: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_request(payload, job="job")


def test_error_keeps_the_request_id_when_it_could_be_read() -> None:
    with pytest.raises(ProtocolError, match="wrong job 'other'") as caught:
        decode_request(_raw(job="other"), job="job")

    assert caught.value.msg_id == "m1"


def test_optional_fields_may_be_null_and_extra_fields_pass() -> None:
    body = {"worker_id": "w0", "generation": 0, "step": 3, "epoch": None, "future_field": 1}

    assert decode_request(_raw(type="coordinate", body=body)).body == body


def test_encoding_refuses_invalid_and_oversized_requests() -> None:
    with pytest.raises(ProtocolError, match="unknown message type"):
        encode_request("m1", "job", "dance", {})
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        encode_request("m1", "job", "shutdown", {"reason": "x" * MAX_MESSAGE_BYTES})
    with pytest.raises(ProtocolError, match="request id"):
        encode_request("", "job", "status", {})


def test_reply_round_trip() -> None:
    ok = decode_reply(encode_reply(ok_reply("m1", {"generation": 2})))
    error = decode_reply(encode_reply(error_reply(None, "unknown worker w9")))

    assert (ok.id, ok.ok, ok.body) == ("m1", True, {"generation": 2})
    assert (error.id, error.ok, error.error) == (None, False, "unknown worker w9")


def test_oversized_reply_becomes_an_error_reply() -> None:
    reply = decode_reply(encode_reply(ok_reply("m1", {"blob": "x" * MAX_MESSAGE_BYTES})))

    assert not reply.ok
    assert reply.id == "m1"
    assert "exceeds the limit" in (reply.error or "")


@pytest.mark.parametrize(
    "payload",
    [b'{"v": 1, "id": "m1"}', b'{"v": 1, "id": "m1", "ok": true}', b'{"v": 1, "id": "m1", "ok": false}', b"[]"],
)
def test_invalid_replies_are_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(payload)


@pytest.mark.parametrize(("value", "depth"), [(1, 0), ([], 1), ({"a": [1, {"b": []}]}, 4), ([[[]], [[[[]]]]], 5)])
def test_nesting_depth(value: object, depth: int) -> None:
    assert nesting_depth(value) == depth


@pytest.mark.parametrize("depth", [MAX_NESTING, 2_000, 200_000])
def test_frames_nested_too_deeply_are_protocol_errors(depth: int) -> None:
    payload = b'{"v": 1, "id": "m1", "job": "job", "type": "status", "body": {"x": ' + b"[" * depth + b"]" * depth
    payload += b"}}"

    with pytest.raises(ProtocolError, match=f"nests deeper than {MAX_NESTING} levels"):
        decode_request(payload)
    with pytest.raises(ProtocolError, match="nests deeper"):
        decode_reply(b"[" * (depth + 1) + b"]" * (depth + 1))


def test_a_report_may_carry_its_step() -> None:
    payload = encode_request("m1", "job", "report", AdjustmentReport("w1", 2, "stayer", step=31).to_body())

    assert AdjustmentReport.from_body(decode_request(payload).body).step == 31
    with pytest.raises(ProtocolError, match="field 'step' must be int"):
        encode_request("m2", "job", "report", {"worker_id": "w1", "generation": 2, "role": "stayer", "step": "31"})

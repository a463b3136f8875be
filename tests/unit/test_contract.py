"""The typed contract: wire forms unchanged, plan helpers, reply parsing, schemas and dataclasses in agreement."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import pytest

from lightning_elan.protocol import contract
from lightning_elan.protocol.contract import (
    BODY_SCHEMAS,
    MESSAGE_TYPES,
    MESSAGES,
    MUTATING_TYPES,
    READ_ONLY_TYPES,
    TYPED_REQUESTS,
    AdjustmentPlan,
    AdjustmentReport,
    AMStatus,
    AutoscaleReply,
    CoordinateReply,
    CoordinateRequest,
    EmptyReply,
    LauncherPollReply,
    LeaveReply,
    MemberStatus,
    ProfileReply,
    ProtocolError,
    RegisterRequest,
    ScaleCommand,
    ScaleReply,
    ShutdownRequest,
    SpawnOrder,
    StartJobReply,
    StartJobRequest,
    StatusReply,
    StatusRequest,
    StragglersReply,
    Transfer,
    WaitPlanReply,
    WaitPlanRequest,
    WorkerExitReply,
    WorkerExitRequest,
    WorkerPollReply,
    WorkerStatsReply,
    required_fields,
)
from lightning_elan.protocol.messages import decode_request, encode_request, validate_body

# the plan of docs/architecture.md, *Plan*, with the planner's transfers: the wire form the AM has always sent
WIRE_PLAN = {
    "request_id": "r1", "action": "add", "generation": 1, "previous_generation": 0, "step": 20,
    "members": ["w0", "w1", "w2", "w3", "w4"], "previous_members": ["w0", "w1"],
    "joiners": ["w2", "w3", "w4"], "leavers": [], "sources": {"w2": "w0", "w3": "w1", "w4": "w0"},
    "hosts": {"w0": "host", "w1": "host", "w2": "host", "w3": "host", "w4": None},
    "transfers": [
        {"source": "w0", "joiner": "w2", "level": 2, "wave": 0, "transport": "shm"},
        {"source": "w1", "joiner": "w3", "level": 1, "wave": 0, "transport": "cuda_ipc"},
        {"source": "w0", "joiner": "w4", "level": 4, "wave": 1, "transport": "collective"},
    ],
}


def plan_without_transfers() -> AdjustmentPlan:
    return AdjustmentPlan.from_dict({key: value for key, value in WIRE_PLAN.items() if key != "transfers"})


# ---- AdjustmentPlan ------------------------------------------------------------------------------------------------


def test_plan_round_trips_through_its_unchanged_wire_form_with_typed_transfers() -> None:
    plan = AdjustmentPlan.from_dict(json.loads(json.dumps(WIRE_PLAN)))

    assert plan.transfers is not None and all(isinstance(t, Transfer) for t in plan.transfers)
    assert plan.transfers[1] == Transfer("w1", "w3", level=1, wave=0, transport="cuda_ipc")
    assert plan.to_dict() == WIRE_PLAN
    assert list(plan.to_dict()) == list(WIRE_PLAN)  # same key order as before
    assert AdjustmentPlan.from_dict(plan.to_dict()) == plan


def test_a_plan_without_transfers_has_none_and_leaves_the_key_out() -> None:
    plan = plan_without_transfers()

    assert plan.transfers is None
    assert "transfers" not in plan.to_dict()


def test_plan_from_dict_names_a_missing_field_and_ignores_unknown_ones() -> None:
    with pytest.raises(ProtocolError, match="plan: missing field\\(s\\) 'sources'"):
        AdjustmentPlan.from_dict({key: value for key, value in WIRE_PLAN.items() if key != "sources"})
    with pytest.raises(ProtocolError, match="plan must be an object"):
        AdjustmentPlan.from_dict(["r1"])  # type: ignore[arg-type]

    assert AdjustmentPlan.from_dict({**WIRE_PLAN, "from_a_newer_am": 1}).to_dict() == WIRE_PLAN


def test_rank_of_is_the_new_rank_order_and_refuses_non_members() -> None:
    plan = AdjustmentPlan.from_dict(
        {**WIRE_PLAN, "members": ["w1", "w3", "w4"], "previous_members": ["w0", "w1"], "joiners": ["w3", "w4"],
         "leavers": ["w0"], "sources": {"w3": "w1", "w4": "w1"}, "transfers": None}
    )

    assert [plan.rank_of(worker) for worker in ("w1", "w3", "w4")] == [0, 1, 2]
    assert plan.world_size == 3
    assert plan.stayers == ["w1"]
    assert plan.involves("w0") and not plan.involves("w2")
    with pytest.raises(ValueError, match="worker w0 is not a member of generation 1"):
        plan.rank_of("w0")


def test_joiners_served_by_lists_a_sources_joiners_in_plan_order() -> None:
    plan = AdjustmentPlan.from_dict(WIRE_PLAN)

    assert plan.joiners_served_by("w0") == ["w2", "w4"]
    assert plan.joiners_served_by("w1") == ["w3"]
    assert plan.joiners_served_by("w2") == []


def test_coordinate_replies_parse_from_and_to_their_wire_form() -> None:
    none = CoordinateReply.from_body({"decision": "none"})
    adjust = CoordinateReply.from_body(json.loads(json.dumps({"decision": "adjust", "plan": WIRE_PLAN})))

    assert none == CoordinateReply.none() and none.plan is None
    assert adjust.decision == "adjust" and adjust.plan == AdjustmentPlan.from_dict(WIRE_PLAN)
    assert adjust.to_body() == {"decision": "adjust", "plan": WIRE_PLAN}
    assert none.to_body() == {"decision": "none"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"decision": "maybe"}, "unknown decision 'maybe'"),
        ({}, "unknown decision None"),
        ({"decision": "adjust"}, "decision 'adjust' with plan None"),
    ],
)
def test_invalid_coordinate_replies_are_refused(body: dict, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        CoordinateReply.from_body(body)


def test_wait_plan_replies_parse_each_status() -> None:
    plan = AdjustmentPlan.from_dict(WIRE_PLAN)

    assert WaitPlanReply.from_body({"status": "wait"}) == WaitPlanReply.wait()
    assert WaitPlanReply.from_body({"status": "plan", "plan": WIRE_PLAN}) == WaitPlanReply.with_plan(plan)
    cancelled = WaitPlanReply.from_body({"status": "cancelled", "reason": "job finished: done"})
    assert (cancelled.status, cancelled.plan, cancelled.reason) == ("cancelled", None, "job finished: done")
    assert cancelled.to_body() == {"status": "cancelled", "reason": "job finished: done"}
    assert WaitPlanReply.with_plan(plan).to_body() == {"status": "plan", "plan": WIRE_PLAN}
    with pytest.raises(ProtocolError, match="unknown status 'later'"):
        WaitPlanReply.from_body({"status": "later"})
    with pytest.raises(ProtocolError, match="status 'plan' with plan None"):
        WaitPlanReply.from_body({"status": "plan"})


# ---- request bodies --------------------------------------------------------------------------------------------------

REQUESTS = [
    RegisterRequest("w3", host="n0", device="cuda:1", pid=42, topology={"host": "n0", "socket": 1}),
    CoordinateRequest("w0", 2, 40, epoch=1, position=1280, global_batch=32,
                      scaling={"policy": "hybrid", "model_ready": False}),
    WaitPlanRequest("w5", timeout_s=5.0),
    AdjustmentReport("w2", 3, "joiner", pause_s=0.25, bytes_sent=0, bytes_received=10, startup_s=4.5,
                     global_batch=24, scaling={"global_batch": 24, "local_batch": 8, "k": 1, "reason": "r"}),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.TYPE)
def test_request_bodies_pass_validation_and_come_back_equal(request_: object) -> None:
    payload = encode_request("m1", "job", request_.TYPE, request_.to_body())  # validated against BODY_SCHEMAS

    assert type(request_).from_body(decode_request(payload, job="job").body) == request_


def test_optional_none_fields_are_left_out_of_the_body_and_extra_keys_ignored() -> None:
    body = CoordinateRequest("w0", 0, 5).to_body()

    assert body == {"worker_id": "w0", "generation": 0, "step": 5}
    assert AdjustmentReport("w1", 1, "stayer", pause_s=0.0).to_body() == {
        "worker_id": "w1", "generation": 1, "role": "stayer", "pause_s": 0.0
    }
    assert CoordinateRequest.from_body({**body, "future_field": 1}) == CoordinateRequest("w0", 0, 5)
    with pytest.raises(ProtocolError, match="report: missing field\\(s\\) 'generation', 'role'"):
        AdjustmentReport.from_body({"worker_id": "w1"})


@pytest.mark.parametrize("message", TYPED_REQUESTS, ids=lambda m: m.TYPE)
def test_each_dataclass_has_exactly_its_schemas_fields_and_required_ones(message: type) -> None:
    schema = BODY_SCHEMAS[message.TYPE]

    assert schema is message.SCHEMA
    assert [f.name for f in fields(message)] == list(schema)
    assert required_fields(message) == [name for name, spec in schema.items() if spec.required]


# ---- names, version, purity ------------------------------------------------------------------------------------------


def test_every_environment_variable_has_the_one_prefix() -> None:
    names = [value for name, value in vars(contract).items() if name.startswith("ENV_") and name != "ENV_PREFIX"]

    assert len(names) == len(set(names))
    assert sorted(names) == sorted(contract.WORKER_ENV_VARS + contract.USER_ENV_VARS + contract.COMMAND_ENV_VARS)
    assert all(name.startswith(contract.ENV_PREFIX) for name in names)
    assert set(contract.USER_ENV_VARS).isdisjoint(contract.WORKER_ENV_VARS)


def test_frames_carry_the_contract_version() -> None:
    frame = json.loads(encode_request("m1", "job", "status", {}))

    assert frame["v"] == contract.PROTOCOL_VERSION == contract.CONTRACT_VERSION


def test_the_contract_imports_no_torch_lightning_or_zmq() -> None:
    code = (
        "import sys, lightning_elan.protocol.contract, lightning_elan.protocol.messages; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'zmq')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert result.stdout.strip() == "[]"


def test_one_registry_names_every_message_type_its_body_and_whether_it_is_cached() -> None:
    assert set(MESSAGES) == MESSAGE_TYPES == MUTATING_TYPES | READ_ONLY_TYPES
    assert not MUTATING_TYPES & READ_ONLY_TYPES
    # never cached: repeating them is harmless
    assert READ_ONLY_TYPES == {"status", "wait_plan", "worker_poll", "worker_stats"}
    for name, kind in MESSAGES.items():
        assert kind.body.TYPE == name and BODY_SCHEMAS[name] is kind.body.SCHEMA


@pytest.mark.parametrize("message", [WorkerExitRequest("w3", -9), ShutdownRequest("all members finished"),
                                     ScaleCommand("remove", ranks=[0]), StartJobRequest(3, 1, replace_failed=True),
                                     StatusRequest()], ids=lambda m: m.TYPE)
def test_a_launcher_request_crosses_the_wire_unchanged(message: object) -> None:
    body = message.to_body()  # type: ignore[attr-defined]
    validate_body(message.TYPE, body)  # type: ignore[attr-defined]
    assert type(message).from_body(json.loads(json.dumps(body))) == message  # type: ignore[attr-defined]


# ---- the launcher's and the command line's replies -------------------------------------------------------------------

STATUS_BODY = {
    "job": "j", "generation": 1,
    "members": [{"worker_id": "w0", "rank": 0, "host": "h", "device": "cpu", "pid": 7, "joined_generation": 0,
                 "last_step": 9, "last_step_from": "coordinate", "last_seen_at": 1.5}],
    "step": 9, "epoch": 0, "position": 72, "global_batch": 8, "scaling": None,
    "pending": [{"request_id": "r2", "action": "add", "count": 1, "worker_status": {"w3": "spawned"}}],
    "in_flight": WIRE_PLAN, "last_adjustment": None, "failures": [],
    "am": {"restarts": 0, "pid": 42, "address": "tcp://127.0.0.1:5555", "started_at": 1.0, "reply_cache_entries": 3,
           "parked_waits": 0},
    "recovery": None, "enrolment": None, "standby": None, "sizing": {"profile": None, "measured": {}},
    "finished": False, "failed_reason": None, "finish_reason": None,
}

REPLIES = [
    (StartJobReply, {"generation": 0, "members": ["w0", "w1"]}),
    (ScaleReply, {"request_id": "r1", "new_workers": ["w2"]}),
    (LauncherPollReply, {"spawn": [{"worker_id": "w2", "request_id": "standby"}], "stop": ["w1"], "finished": False}),
    (LauncherPollReply, {"spawn": [], "stop": [], "finished": False, "kill": ["w2"]}),
    (WorkerExitReply, {"expected": True}),
    (WorkerExitReply, {"expected": False, "left": True}),
    (WorkerExitReply, {"expected": False, "recovering": True, "failed_generations": [0, 1]}),
    (WorkerExitReply, {"expected": False, "recovering": False}),
    (StatusReply, STATUS_BODY),
    (ProfileReply, {"profile": {"run": {"min_size": 1, "max_size": 2}, "measured": {}}}),
    (AutoscaleReply, {"autoscale": None}),
    (AutoscaleReply, {"autoscale": {"policy": "throughput", "config": {"every": 20}}}),
    (StragglersReply, {"stragglers": {"mode": "replace", "alpha": 0.1, "threshold": 0.8, "window": 5}}),
    (WorkerStatsReply, {"stragglers": [], "ignored": True}),
    (LeaveReply, {"outcome": "finished", "request_id": None}),
    (EmptyReply, {}),
]


@pytest.mark.parametrize(("reply", "body"), REPLIES, ids=lambda value: getattr(value, "__name__", ""))
def test_a_reply_parses_from_its_wire_form_and_gives_it_back_unchanged(reply: type, body: dict) -> None:
    parsed = reply.from_body(json.loads(json.dumps(body)))  # type: ignore[attr-defined]

    assert parsed.to_body() == body
    assert list(parsed.to_body()) == list(body)  # same keys, same order


def test_typed_parts_of_the_status_reply() -> None:
    status = StatusReply.from_body(STATUS_BODY)

    assert status.members == [MemberStatus("w0", 0, "h", "cpu", 7, 0, 9, "coordinate", 1.5)]
    assert status.member_ids() == ["w0"] and status.in_flight == AdjustmentPlan.from_dict(WIRE_PLAN)
    assert status.am == AMStatus(0, 42, "tcp://127.0.0.1:5555", 1.0, 3, 0)
    assert status.pending[0]["worker_status"] == {"w3": "spawned"}  # the free-form parts stay as the AM sent them
    assert LauncherPollReply.from_body({"spawn": [{"worker_id": "w2", "request_id": "r1"}], "stop": [],
                                        "finished": True}).spawn == [SpawnOrder("w2", "r1")]


@pytest.mark.parametrize(
    ("reply", "body", "message"),
    [
        (StatusReply, {"job": "j", "generation": 0, "members": []}, r"status reply: missing field\(s\) 'finished'"),
        (StatusReply, {**STATUS_BODY, "members": [{"rank": 0}]}, r"status member: missing field\(s\) 'worker_id'"),
        (StatusReply, {**STATUS_BODY, "members": {"w0": 0}}, r"status reply: 'members' must be a list, got dict"),
        (LauncherPollReply, {"spawn": []}, r"launcher_poll reply: missing field\(s\) 'stop', 'finished'"),
        (LauncherPollReply, {"spawn": [{"worker_id": "w1"}], "stop": [], "finished": False},
         r"spawn item: missing field\(s\) 'request_id'"),
        (WorkerExitReply, {"recovering": True}, r"worker_exit reply: missing field\(s\) 'expected'"),
        (WorkerPollReply, {"training_over": True}, r"worker_poll reply: missing field\(s\) 'kill'"),
        (ScaleReply, {"request_id": "r1"}, r"scale reply: missing field\(s\) 'new_workers'"),
        (StartJobReply, [], "start_job reply must be an object, got list"),
        (StragglersReply, {"stragglers": {"mode": "off"}},
         r"straggler settings: missing field\(s\) 'alpha', 'threshold', 'window'"),
    ],
)
def test_a_reply_missing_a_field_is_a_protocol_error_that_names_it(reply: type, body: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        reply.from_body(body)  # type: ignore[attr-defined]


def test_worker_exit_carries_the_store_marks_and_a_sender_without_them_is_still_valid() -> None:
    old_sender = {"worker_id": "w1", "returncode": -9}
    validate_body("worker_exit", old_sender)

    assert WorkerExitRequest.from_body(old_sender) == WorkerExitRequest("w1", -9, None, None)
    marked = WorkerExitRequest("w1", -9, training_ended=True, script_failed=False)
    assert marked.to_body() == {**old_sender, "training_ended": True, "script_failed": False}
    with pytest.raises(ProtocolError, match="training_ended"):
        validate_body("worker_exit", {**old_sender, "training_ended": "yes"})


def test_the_registry_names_each_types_reply_dataclass() -> None:
    assert MESSAGES["status"].reply is StatusReply and MESSAGES["recover"].reply is WaitPlanReply
    assert MESSAGES["worker_exit"].reply is WorkerExitReply and MESSAGES["shutdown"].reply is EmptyReply
    for kind in MESSAGES.values():
        assert callable(kind.reply.to_body) and callable(kind.reply.from_body)


def test_the_am_refuses_to_start_with_handlers_out_of_step_with_the_registry() -> None:
    from lightning_elan.master.server import _check_handlers

    with pytest.raises(RuntimeError, match=r"no handler for \['worker_exit'\], handlers of unknown types \['reboot'\]"):
        _check_handlers({**{name: None for name in MESSAGES if name != "worker_exit"}, "reboot": None})
    _check_handlers(dict.fromkeys(MESSAGES))

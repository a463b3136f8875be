"""Issue 10, item 5: bad messages at a live AM while a real job trains leave the job, and the AM, unaffected.

A seeded fuzzer sends ≥ ``MIN_FRAMES`` frames over a real ZeroMQ DEALER, as fast as its loop goes (a window of
``WINDOW`` unanswered frames), at the AM of an `elan run` job that grows and shrinks (``SCHEDULE``): random bytes,
truncated JSON, JSON that is not an object, a wrong type in every field of every message type (envelope and nested
scaling fields included), the wrong job, oversized and too deeply nested frames, several frames in one message, valid
frames of stale generations and unknown or departed workers, and replays of the job's real message ids (read from the
AM's persisted reply cache) with bodies that would change the state if they were applied again. Every frame must be
answered as predicted (an error, an ok, or exactly the cached reply); afterwards the job must be exact (the static run's
parameters within 1e-9, each sample once, bit-identical members, the scheduled adjustments only), the AM must still
answer ``status`` with nothing recorded by the fuzz (no failure, no restart, its caches bounded) and its process's RSS
must not grow with the number of frames.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from lightning_elan.protocol.client import AMClient
from lightning_elan.protocol.contract import BODY_SCHEMAS, SCALING_SUMMARY, Field
from lightning_elan.protocol.messages import MAX_MESSAGE_BYTES, MAX_NESTING, _matches
from tests.integration.elastic_runs import (
    PROBE_ARGS,
    RunResult,
    check_elastic_run,
    elan_command,
    elan_env,
)

pytestmark = pytest.mark.integration

SEED = 20240610
MIN_FRAMES = 10_000
FUZZ_LIMIT_S = 100.0  # the fuzz runs from the job's start until its second adjustment completed (and MIN_FRAMES)
WINDOW = 32
REPLY_TIMEOUT_S = 20.0
SCHEDULE = "4:add=1,12:remove=1"
JOB = "fuzz"
STEP_SLEEP = "0.25"  # slows training so that the whole fuzz runs while the job trains (no effect on the numbers)
RSS_GROWTH_LIMIT = 48 << 20  # bytes the AM process may grow between the first and the last thousand frames

ANY, OK, ERROR = "any", "ok", "error"


@dataclass
class Frame:
    """One message to send and what its reply must be."""

    parts: list[bytes]
    reply_id: str | None  # the id the reply carries (None: the AM could not read one)
    expect: str  # ANY, OK or ERROR
    equals: dict[str, Any] | None = None  # the exact reply (a replay of a cached id)
    kind: str = ""


@dataclass
class JobView:
    """What the fuzzer knows of the job, refreshed from ``status`` and the AM's store while it runs."""

    generation: int = 0
    members: list[str] = field(default_factory=lambda: ["w0", "w1"])
    completed_generation: int | None = None  # generation of the last completed adjustment
    replies: list[list[Any]] = field(default_factory=list)  # [id, type, reply, stored_at] of real requests


# ---------------------------------------------------------------------- the frame generator


WRONG_VALUES: list[Any] = ["text", 7, 2.5, True, [1, "x"], {"k": 1}, -1]


def wrong_values(spec: Field) -> list[Any]:
    """Values of the wrong JSON type for ``spec`` (never null: null is valid for an optional field)."""
    values = [value for value in WRONG_VALUES if not _matches(value, spec.types)]
    if spec.item_type is not None:
        values.append([1, "x", None])
    return values


def valid_body(msg_type: str) -> dict[str, Any]:
    """A body that passes validation (the fuzzer breaks one field of it)."""
    bodies: dict[str, dict[str, Any]] = {
        "start_job": {"nproc": 2, "coordinate_every": 1, "hosts": ["a", "b"], "report_timeout_s": 5.0},
        "scale": {"action": "add", "count": 1, "at_step": 3},
        "status": {},
        "launcher_poll": {},
        "worker_exit": {"worker_id": "w0", "returncode": 1},
        "shutdown": {"reason": "fuzz"},
        "register": {"worker_id": "w0", "host": "h", "device": "cpu", "pid": 1, "topology": {"host": "h"}},
        "coordinate": {"worker_id": "w0", "generation": 0, "step": 1, "epoch": 0, "position": 0, "global_batch": 12,
                       "scaling": {"policy": "strong", "model_ready": False, "world_size": 2, "global_batch": 12}},
        "wait_plan": {"worker_id": "w0", "timeout_s": 0},
        "recover": {"worker_id": "w0", "generation": 0, "has_state": True, "step": 1, "timeout_s": 0},
        "stalled": {"worker_id": "w0", "generation": 0, "waited_s": 10.0, "detail": "gloo: Timed out"},
        "worker_poll": {"worker_id": "w0"},
        "enrol": {"host": "h", "pid": 1, "worker_id": "w9"},  # only ever sent broken (this job takes no enrolments)
        "leave": {"worker_id": "w0"},  # only ever sent broken (a valid one would remove w0)
        "worker_stats": {"worker_id": "w0", "generation": 0, "step": 1, "steps": 1, "compute_s": 0.01},
        # the AM's sizing requests: only ever sent broken (a valid one would resize the job or change its policy)
        "profile": {"min": 1, "max": 2, "steps": 5, "settle": "return"},
        "autoscale": {"policy": "off", "every": 5, "step": 1, "threshold": 0.1, "min_workers": 1, "max_workers": 2,
                      "cooldown_s": 0.0, "price": 1.0, "utility": {"points": [[0, 1], [10, 0]]},
                      "scale_out_command": "true"},
        "stragglers": {"mode": "off", "threshold": 0.8, "window": 5, "alpha": 0.1},
        "report": {"worker_id": "w0", "generation": 1, "role": "stayer", "pause_s": 0.1, "bytes_sent": 1,
                   "bytes_received": 1, "startup_s": 1.0, "global_batch": 12, "received_from": "w0",
                   "received_over": "shm", "step": 3},
    }
    return dict(bodies[msg_type])


class Fuzzer:
    """Seeded frames of every kind; ``next_frame(view)`` picks one."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count = 0
        self.kinds = [
            (self.random_bytes, 10), (self.truncated, 10), (self.not_an_object, 4), (self.wrong_field_type, 30),
            (self.wrong_envelope, 8), (self.wrong_job, 8), (self.oversized, 0.4), (self.too_deep, 1),
            (self.several_parts, 2), (self.stale, 12), (self.replay, 10), (self.replay_as_other_type, 2),
            (self.status, 2),
        ]

    def next_frame(self, view: JobView) -> Frame:
        make = self.rng.choices([kind for kind, _ in self.kinds], weights=[w for _, w in self.kinds])[0]
        frame = make(view)
        frame.kind = make.__name__
        return frame

    def new_id(self) -> str:
        self.count += 1
        return f"fz-{self.count}"

    def request(self, msg_type: str, body: Any, msg_id: str | None = None, job: Any = JOB, **envelope: Any) -> dict:
        message = {"v": 1, "id": msg_id or self.new_id(), "job": job, "type": msg_type, "body": body}
        message.update(envelope)
        return message

    @staticmethod
    def encode(message: Any) -> bytes:
        return json.dumps(message, separators=(",", ":")).encode()

    # ---- kinds

    def random_bytes(self, view: JobView) -> Frame:
        data = bytes(self.rng.getrandbits(8) for _ in range(self.rng.randint(0, 300)))
        return Frame([data], None, ERROR)

    def truncated(self, view: JobView) -> Frame:
        msg_type = self.rng.choice(sorted(BODY_SCHEMAS))
        data = self.encode(self.request(msg_type, valid_body(msg_type)))
        return Frame([data[: self.rng.randint(0, len(data) - 1)]], None, ERROR)

    def not_an_object(self, view: JobView) -> Frame:
        value = self.rng.choice([[1, 2], "status", 42, None, True, [{"v": 1}]])
        return Frame([self.encode(value)], None, ERROR)

    def wrong_field_type(self, view: JobView) -> Frame:
        """A wrong type in one field of one message type (nested scaling fields of coordinate included)."""
        msg_type = self.rng.choice([t for t, schema in BODY_SCHEMAS.items() if schema])
        body = valid_body(msg_type)
        name = self.rng.choice(sorted(BODY_SCHEMAS[msg_type]))
        if msg_type == "coordinate" and name == "scaling" and self.rng.random() < 0.5:
            nested = self.rng.choice(sorted(SCALING_SUMMARY))
            body["scaling"] = {**body["scaling"], nested: self.rng.choice(wrong_values(SCALING_SUMMARY[nested]))}
        else:
            body[name] = self.rng.choice(wrong_values(BODY_SCHEMAS[msg_type][name]))
        message = self.request(msg_type, body)
        return Frame([self.encode(message)], message["id"], ERROR)

    def wrong_envelope(self, view: JobView) -> Frame:
        msg_type = self.rng.choice(sorted(BODY_SCHEMAS))
        message = self.request(msg_type, valid_body(msg_type))
        name = self.rng.choice(["v", "id", "job", "type", "body"])
        bad = {"v": ["1", 2, True, None, 1.5], "id": [7, "", "x" * 201, None, ["a"]], "job": [1, None, ["fuzz"]],
               "type": [1, "dance", None, ""], "body": [[], "x", 1, None, True]}[name]
        message[name] = self.rng.choice(bad)
        reply_id = message["id"] if name != "id" else None
        return Frame([self.encode(message)], reply_id, ERROR)

    def wrong_job(self, view: JobView) -> Frame:
        msg_type = self.rng.choice(sorted(BODY_SCHEMAS))
        job = self.rng.choice(["other", "FUZZ", "fuzz ", "", "fuzz" * 50])
        message = self.request(msg_type, valid_body(msg_type), job=job)
        return Frame([self.encode(message)], message["id"], ERROR)

    def oversized(self, view: JobView) -> Frame:
        message = self.request("status", {"pad": "x" * (MAX_MESSAGE_BYTES + self.rng.randint(1, 4096))})
        return Frame([self.encode(message)], None, ERROR)

    def too_deep(self, view: JobView) -> Frame:
        depth = self.rng.choice([MAX_NESTING + 1, 500, 5_000, 100_000])
        data = b'{"v":1,"id":"deep","job":"fuzz","type":"status","body":{"x":' + b"[" * depth + b"]" * depth + b"}}"
        return Frame([data], None, ERROR)

    def several_parts(self, view: JobView) -> Frame:
        message = self.encode(self.request("status", {}))
        return Frame([*[message, message, b"x"][: self.rng.randint(2, 3)], b"tail"], None, ERROR)

    def stale(self, view: JobView) -> Frame:
        """Valid frames the AM must refuse or ignore: stale generations, unknown and departed workers."""
        choice = self.rng.randrange(6)
        member = self.rng.choice(view.members)
        if choice == 0 and view.generation > 0:  # a coordinate of an older generation
            body = {"worker_id": member, "generation": self.rng.randrange(view.generation), "step": 1}
            return self.valid("coordinate", body, ERROR)
        if choice == 1:  # negative generation
            body = {"worker_id": member, "generation": -self.rng.randint(1, 9), "step": 1}
            return self.valid(self.rng.choice(["coordinate", "report"]), {**body, "role": "stayer"}, ERROR)
        if choice == 2:  # a late report for an adjustment already recorded, or for generation 0: ignored
            generation = view.completed_generation if view.completed_generation is not None else 0
            return self.valid("report", {"worker_id": member, "generation": generation, "role": "stayer"}, OK)
        unknown = f"w{self.rng.randint(100, 10_000)}"
        if choice == 3:
            return self.valid("register", {"worker_id": unknown, "host": "h", "pid": 5}, ERROR)
        if choice == 4:
            msg_type = self.rng.choice(["wait_plan", "worker_exit", "coordinate", "report"])
            body = {"worker_id": unknown, "timeout_s": 0, "returncode": 0, "generation": view.generation, "step": 1,
                    "role": "joiner"}
            return self.valid(msg_type, body, ERROR)
        return self.valid("wait_plan", {"worker_id": member, "timeout_s": 0}, OK)  # answered now, changes nothing

    def valid(self, msg_type: str, body: dict[str, Any], expect: str) -> Frame:
        message = self.request(msg_type, body)
        return Frame([self.encode(message)], message["id"], expect)

    def replay(self, view: JobView) -> Frame:
        """A real request id again, with a body that would change the state if it applied: the cached reply."""
        if not view.replies:
            return self.status(view)
        msg_id, msg_type, reply, _ = self.rng.choice(view.replies)
        replay_bodies = {
            "scale": {"action": "add", "count": 1}, "launcher_poll": {}, "start_job": {"nproc": 3},
            "register": {"worker_id": "w0", "host": "replayed", "pid": 1}, "shutdown": {"reason": "replayed"},
            "worker_exit": {"worker_id": "w0", "returncode": 9},
            "coordinate": {"worker_id": "w0", "generation": view.generation, "step": 0},
            "report": {"worker_id": "w0", "generation": view.generation, "role": "stayer", "pause_s": 99.0},
        }
        message = self.request(msg_type, replay_bodies[msg_type], msg_id=msg_id)
        return Frame([self.encode(message)], msg_id, OK, equals=reply)

    def replay_as_other_type(self, view: JobView) -> Frame:
        if not view.replies:
            return self.status(view)
        msg_id, msg_type, _, _ = self.rng.choice(view.replies)
        other = "register" if msg_type != "register" else "worker_exit"
        message = self.request(other, {"worker_id": "w0", "returncode": 0}, msg_id=msg_id)
        return Frame([self.encode(message)], msg_id, ERROR)

    def status(self, view: JobView) -> Frame:
        return self.valid("status", {}, OK)


# ---------------------------------------------------------------------- sending and checking


class Sender:
    """A DEALER that keeps up to ``WINDOW`` frames unanswered and checks each reply against its frame."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.waiting: dict[str | None, deque[Frame]] = {}
        self.outstanding = 0
        self.sent = 0
        self.by_kind: dict[str, int] = {}
        self.problems: list[str] = []

    def send(self, frame: Frame) -> None:
        while self.outstanding >= WINDOW:
            self.receive()
        self.socket.send_multipart(frame.parts)
        self.waiting.setdefault(frame.reply_id, deque()).append(frame)
        self.outstanding += 1
        self.sent += 1
        self.by_kind[frame.kind] = self.by_kind.get(frame.kind, 0) + 1

    def receive(self) -> None:
        assert self.socket.poll(int(REPLY_TIMEOUT_S * 1000)), (
            f"the AM answered nothing for {REPLY_TIMEOUT_S} s ({self.outstanding} frames unanswered)"
        )
        reply = json.loads(self.socket.recv())
        queue = self.waiting.get(reply.get("id"))
        assert queue, f"a reply to no frame sent: {str(reply)[:300]}"
        self.check(queue.popleft(), reply)
        self.outstanding -= 1

    def check(self, frame: Frame, reply: dict[str, Any]) -> None:
        wrong = (
            (frame.equals is not None and reply != frame.equals)
            or (frame.expect == OK and reply.get("ok") is not True)
            or (frame.expect == ERROR and (reply.get("ok") is not False or not reply.get("error")))
            or "internal error" in str(reply.get("error"))
        )
        if wrong and len(self.problems) < 20:
            self.problems.append(f"{frame.kind} {frame.parts[0][:200]!r} → {str(reply)[:300]}")

    def drain(self) -> None:
        while self.outstanding:
            self.receive()

    def close(self) -> None:
        self.socket.close(linger=0)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def refresh(view: JobView, status: dict[str, Any], state_file: Path) -> None:
    view.generation = status["generation"]
    view.members = [member["worker_id"] for member in status["members"]] or view.members
    last = status.get("last_adjustment")
    view.completed_generation = None if last is None else last["generation"]
    try:
        view.replies = json.loads(state_file.read_text())["replies"]
    except (OSError, ValueError):
        pass  # between two writes of the store: keep the last corpus


def wait_for_job(home: Path, job: subprocess.Popen) -> tuple[AMClient, dict]:
    """The job's AM client once the AM answers with the job started (generation 0 formed)."""
    registry_file = home / "jobs" / f"{JOB}.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if registry_file.exists():
            try:
                address = json.loads(registry_file.read_text())["address"]
            except (OSError, ValueError, KeyError):
                address = None
            if address:
                client = AMClient(address, JOB, timeout_s=5.0, retries=2)
                status = client.status()
                if status["members"]:
                    return client, status
                client.close()
        time.sleep(0.2)
    raise AssertionError(f"the job never started (exit {job.poll()})")


def test_the_fuzzer_has_a_valid_body_for_every_message_type() -> None:
    """A message type added to the protocol must be fuzzed too: each has a body that passes validation."""
    for msg_type, schema in BODY_SCHEMAS.items():
        body = valid_body(msg_type)
        assert {name for name, spec in schema.items() if spec.required} <= set(body), msg_type
        assert set(body) <= set(schema), msg_type


def test_a_flood_of_bad_frames_leaves_a_training_job_and_its_am_unaffected(static_run: RunResult,
                                                                            tmp_path: Path) -> None:
    env = elan_env(tmp_path)
    home = Path(env["ELAN_HOME"])
    command = elan_command(tmp_path, JOB, 2, [*PROBE_ARGS, "--wait-for-joiners", "--step-sleep", STEP_SLEEP],
                           SCHEDULE, coordinate_every=1)
    log_path = tmp_path / f"{JOB}.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        client, status = wait_for_job(home, job)
        am_pid = status["am"]["pid"]
        state_file = tmp_path / f"{JOB}-state" / "state.json"
        view, fuzzer = JobView(), Fuzzer(SEED)
        sender = Sender(client.address)
        rss: list[tuple[int, int]] = []
        steps_seen, generations_seen = [status["step"]], [status["generation"]]
        started = time.monotonic()
        try:
            while True:
                if sender.sent % 500 == 0:
                    status = client.status()
                    steps_seen.append(status["step"])
                    generations_seen.append(status["generation"])
                    refresh(view, status, state_file)
                    rss.append((sender.sent, rss_bytes(am_pid)))
                    r2_done = (status.get("last_adjustment") or {}).get("request_id") == "r2"
                    if sender.sent >= MIN_FRAMES and r2_done:
                        break
                    assert job.poll() is None, f"the job ended after {sender.sent} frames (exit {job.returncode})"
                    assert time.monotonic() - started < FUZZ_LIMIT_S, f"{sender.sent} frames, steps {steps_seen}"
                sender.send(fuzzer.next_frame(view))
            sender.drain()
            fuzz_s = time.monotonic() - started
            final = client.status()  # the AM still answers, correctly, after the flood
            rss.append((sender.sent, rss_bytes(am_pid)))
        finally:
            sender.close()
            client.close()
        returncode = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    output = log_path.read_text()
    run = RunResult(tmp_path / JOB, tmp_path / f"{JOB}-state", returncode, output)

    assert not sender.problems, "\n".join(sender.problems)
    assert sender.sent >= MIN_FRAMES and set(sender.by_kind) >= {kind.__name__ for kind, _ in fuzzer.kinds}
    assert generations_seen[0] == 0 and generations_seen[-1] == 2, "both adjustments happened during the fuzz"
    trained = [step for step in steps_seen if step is not None]
    assert steps_seen[0] in (None, 0, 1) and trained and trained[-1] >= 12, f"steps seen while fuzzing: {steps_seen}"
    check_elastic_run(run, static_run, SCHEDULE, sizes=[3, 2])
    assert final["job"] == JOB and final["generation"] == 2 and not final["finished"]
    assert [member["worker_id"] for member in final["members"]] == ["w0", "w1"]
    assert all(member["pid"] and member["host"] for member in final["members"]), "a replayed register applied"
    assert [request["request_id"] for request in final["pending"]] == [] and final["in_flight"] is None
    assert final["failures"] == [], "the fuzz failed or cancelled something"
    assert final["am"]["pid"] == am_pid and final["am"]["restarts"] == 0
    assert final["am"]["reply_cache_entries"] < 200 and final["am"]["parked_waits"] == 0
    assert "internal error" not in output and "Traceback" not in output
    baseline = next(value for sent, value in rss if sent >= 1000)
    growth = max(value for _, value in rss) - baseline
    assert growth < RSS_GROWTH_LIMIT, f"AM process grew {growth / 2**20:.1f} MiB over {sender.sent} frames"
    print(f"fuzz: {sender.sent} frames in {fuzz_s:.1f} s ({sender.sent / fuzz_s:.0f}/s) over steps "
          f"{trained[0]}..{trained[-1]}, kinds {sender.by_kind}, "
          f"AM RSS {baseline / 2**20:.1f} → {rss[-1][1] / 2**20:.1f} MiB (max growth {growth / 2**20:.1f} MiB)")

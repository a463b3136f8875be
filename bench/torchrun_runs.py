"""torchrun elastic: nodes added and removed as torch's documentation prescribes.

Each "node" is one ``torchrun`` agent with one worker, all on 127.0.0.1, with ``--nnodes=2:3``. Scale out = start a
third agent: the running agents see a node waiting at their next monitor tick, stop their workers and re-rendezvous
with it. Scale in = terminate the third agent (SIGTERM to its process group, as a node shutting down): the surviving
workers' collective fails, their agents restart them in a new rendezvous round of 2. The training script checkpoints
every ``--ckpt-every`` steps and resumes from the latest checkpoint at start (torchrun's "train script" contract), so
the steps since that checkpoint are redone: they are part of the pause (no new progress).

Two rendezvous backends: ``c10d`` (a TCPStore hosted by the first agent) and ``etcd-v2`` against a real local etcd
(``etcd --enable-v2=true``). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set for every agent: with the default
(the agents share the rendezvous TCPStore with their workers) a node that joins a running job waits forever for the
MASTER_ADDR/MASTER_PORT of the new round, which the other agents never publish again (they cached theirs in the
first round); see docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.analysis import Pause, ProcessSteps, load_steps, pause_around, split_at
from bench.common import Follower, Scenario, stop_margin, write_stop_file
from bench.etcd import EtcdServer
from bench.procs import LOOPBACK, Children, bench_env, free_port, kill_strays

log = logging.getLogger(__name__)

# Every documented knob that shortens torchrun's restart path, set in its favour (torch's defaults in brackets):
# last call [30 s] is waited at every rendezvous below --nnodes' maximum, and a node that went away blocks the
# next round until keep_alive_interval × keep_alive_max_attempt [5 s × 3] has passed since its last heartbeat.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=600"


@dataclass
class TorchrunAdjustment:
    action: str
    triggered_at: float
    pause: Pause | None

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "triggered_at": self.triggered_at,
                "pause": self.pause.as_dict() if self.pause else None}


@dataclass
class TorchrunJob:
    backend: str
    model: str
    launched_at: float
    steps_dir: Path
    adjustments: list[TorchrunAdjustment] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "launched_at": self.launched_at,
                "steps_dir": str(self.steps_dir), "adjustments": [a.as_dict() for a in self.adjustments]}


def agent_command(backend: str, endpoint: str, job: str, train_args: list[str]) -> list[str]:
    conf = RDZV_CONF
    if backend == "etcd-v2":
        conf += ",protocol=http"
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", f"--rdzv-conf={conf}",
        "--max-restarts=100", "--monitor-interval=0.1", f"--local-addr={LOOPBACK}",
        "-m", "bench.train", *train_args,
    ]


def run_torchrun_job(scenario: Scenario, backend: str, out: Path, children: Children) -> TorchrunJob:
    """2 agents, then ``torchrun_cycles`` × (start a 3rd agent, stop it), each after ``settle_steps`` new steps."""
    out.mkdir(parents=True, exist_ok=True)
    if backend == "etcd-v2":
        with EtcdServer(out / "etcd") as etcd:
            return _run(scenario, backend, etcd.client_endpoint, out, children)
    return _run(scenario, backend, f"{LOOPBACK}:{free_port()}", out, children)


def _run(scenario: Scenario, backend: str, endpoint: str, out: Path, children: Children) -> TorchrunJob:
    job = f"bench-{backend}-{scenario.model}-{int(time.time())}"
    steps_dir, stop_file = out / "steps", out / "stop"
    train_args = [
        "--launcher", "torchrun", "--model", scenario.model, "--global-batch", str(scenario.global_batch),
        "--max-steps", str(10**7), "--steps-dir", str(steps_dir), "--label", "torchrun",
        "--accelerator", scenario.accelerator, "--ckpt-dir", str(out / "checkpoint"),
        "--ckpt-every", str(scenario.torchrun_ckpt_every), "--stop-file", str(stop_file),
    ]
    env = bench_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "WARNING"})
    command = agent_command(backend, endpoint, job, train_args)
    result = TorchrunJob(backend, scenario.model, time.time(), steps_dir)
    follower = Follower(steps_dir)
    agents = [children.start(command, _agent_env(env, scenario, index), out / "logs" / f"agent{index}.log")
              for index in range(2)]
    triggers: list[tuple[str, float]] = []
    try:
        alive = lambda: all(agent.poll() is None for agent in agents)  # noqa: E731
        follower.wait_for_step(scenario.warmup_steps, scenario.timeout_s, alive)
        for cycle in range(scenario.torchrun_cycles):
            extra = children.start(command, _agent_env(env, scenario, 2), out / "logs" / f"agent-extra{cycle}.log")
            triggers.append(("add", time.time()))
            _wait_for_progress(follower, triggers[-1][1], scenario, alive)
            if "remove" not in scenario.actions:
                agents.append(extra)  # stays to the end
                continue
            triggers.append(("remove", time.time()))
            children.stop(extra)
            _wait_for_progress(follower, triggers[-1][1], scenario, alive)
        write_stop_file(stop_file, follower.max_step() + stop_margin(follower, scenario.stop_margin_steps))
        codes = [agent.wait(scenario.timeout_s) for agent in agents]
        if any(codes):
            raise RuntimeError(f"torchrun agents exited with {codes} (logs in {out / 'logs'})")
    finally:
        for agent in agents:
            children.stop(agent)
        kill_strays(process.pid for process in follower.processes())
    result.adjustments = analyse_torchrun(load_steps(steps_dir), triggers)
    return result


def _agent_env(env: dict[str, str], scenario: Scenario, node: int) -> dict[str, str]:
    """On GPUs every node (agent) gets a device of its own: all workers have LOCAL_RANK 0."""
    return {**env, "CUDA_VISIBLE_DEVICES": str(node)} if scenario.accelerator == "gpu" else env


def _wait_for_progress(follower: Follower, trigger: float, scenario: Scenario, alive: Any) -> None:
    """Wait until workers started after ``trigger`` train ``settle_steps`` steps past the old workers' last step."""
    before, _ = split_at(follower.processes(), trigger)
    deadline = time.monotonic() + scenario.timeout_s
    while True:
        before, after = split_at(follower.processes(), trigger)
        target = max((p.max_step for p in before), default=0) + scenario.settle_steps
        if after and max(p.max_step for p in after) >= target:
            return
        if not alive():
            raise RuntimeError("a torchrun agent exited during an adjustment")
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun job made no progress to step {target} in {scenario.timeout_s:.0f} s")
        time.sleep(0.05)


def analyse_torchrun(processes: list[ProcessSteps], triggers: list[tuple[str, float]]) -> list[TorchrunAdjustment]:
    adjustments = []
    for index, (action, when) in enumerate(triggers):
        until = triggers[index + 1][1] if index + 1 < len(triggers) else float("inf")
        before, after = split_at(processes, when)
        after = [p for p in after if p.start < until]
        last = max((p.max_step for p in before), default=-1)
        adjustments.append(TorchrunAdjustment(action, when, pause_around(before, after, last) if last >= 0 else None))
    return adjustments



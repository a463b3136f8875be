"""Where an elan adjustment's pause goes: one ``add 1`` on a running job, profiled with py-spy.

    python -m bench.profile_adjustment --model 25m

Samples (``py-spy record --idle --format raw``) the joiner's source (w0) and the joiner (w2) through the adjustment,
prints the seconds spent under the strategy's adjustment frames, and the per-phase timings the library logs at DEBUG
(``lightning_elan`` logger), next to the pause measured from the step files.
"""

from __future__ import annotations

import argparse
import collections
import logging
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from bench.analysis import load_steps, pause_around
from bench.common import Follower, Scenario, write_stop_file
from bench.elan_runs import _am_address, _wait_for_adjustment, elan_command
from bench.procs import Children, bench_env
from lightning_elan.protocol.client import AMClient

log = logging.getLogger("bench.profile")

RATE_HZ = 250
FRAMES = {  # the engine's adjustment on the source, and the joiner's join
    "w0": ("ElasticWorker._adjust", "ElasticWorker._send"),
    "w2": ("ElasticWorker.join", "ElasticWorker._receive"),
}


def spy(pid: int, path: Path) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--idle", "--rate", str(RATE_HZ), "--format",
                             "raw", "--nonblocking", "-o", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def children_of(raw: Path, anchor: str, depth: int = 2) -> list[tuple[float, str]]:
    """Seconds under ``anchor``, split by the ``depth`` frames below it."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if anchor in names:
            index = names.index(anchor)
            counts[" > ".join(names[index + 1 : index + 1 + depth]) or "(itself)"] += int(count)
    return [(count / RATE_HZ, key) for key, count in counts.most_common(8)]


def profile(model: str, out: Path) -> None:
    shutil.rmtree(out / "steps", ignore_errors=True)  # a previous run's step files would pass for this one's
    out.mkdir(parents=True, exist_ok=True)
    job = f"profile-{model}-{int(time.time())}"
    env = bench_env({"ELAN_HOME": str(out / "home"), "BENCH_ELAN_LOG": "DEBUG"})
    command = elan_command(Scenario(model), job, out / "state", out / "steps", out / "stop", 10, 10**7)
    children, spies = Children(), []
    try:
        proc = children.start(command, env, out / "run.log")
        alive = lambda: proc.poll() is None  # noqa: E731
        follower = Follower(out / "steps")
        follower.wait_for_step(10, 600, alive)
        spies.append(spy(next(p.pid for p in follower.processes() if p.worker == "w0"), out / "w0.txt"))
        client = AMClient(_am_address(job, out / "home", 60), job, timeout_s=5.0)
        client.scale(action="add", count=1)
        client.close()
        while not any(p.worker == "w2" for p in follower.processes()):
            time.sleep(0.05)
        spies.append(spy(next(p.pid for p in follower.processes() if p.worker == "w2"), out / "w2.txt"))
        record = _wait_for_adjustment(out / "state", 1, 600, alive)
        follower.wait_for_step(int(record["step"]) + 8, 600, alive)
        for process in spies:
            process.send_signal(signal.SIGINT)
            process.wait(60)
        write_stop_file(out / "stop", follower.max_step() + 5)
        proc.wait(120)
    finally:
        for process in spies:
            if process.poll() is None:
                process.kill()
        children.stop_all()
    summarize(out, record)


def summarize(out: Path, record: dict) -> None:
    processes = {p.worker: p for p in load_steps(out / "steps")}
    stayers = [processes[w] for w in record["members"] if w not in record["joiners"]]
    pause = pause_around(stayers, stayers, int(record["step"]))
    print(f"adjustment at step {record['step']}: {record['bytes_replicated'] / 1e6:.1f} MB replicated; "
          f"stayers' gap {pause.gap_s:.3f} s − typical step {pause.typical_step_s:.3f} s = pause {pause.pause_s:.3f} s")
    for worker, anchors in FRAMES.items():
        for anchor in anchors:
            rows = children_of(out / f"{worker}.txt", anchor)
            print(f"{worker} {anchor}: {sum(s for s, _ in rows):.3f} s")
            for seconds, key in rows:
                print(f"    {seconds:.3f} s  {key}")
    pattern = re.compile(r"(transfer .*: (pack|header|broadcast|unpack) [0-9.]+ ms|(in|joined) generation .*)")
    for line in (out / "run.log").read_text().splitlines():
        match = pattern.search(line)
        if match:
            print("log:", match.group(0))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="25m")
    parser.add_argument("--out", type=Path, default=Path("/tmp/elan-bench-profile"))
    args = parser.parse_args()
    profile(args.model, args.out)


if __name__ == "__main__":
    main()

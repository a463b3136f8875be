"""Kills at moments nobody picked, on a sharded job: ``scripts/fsdp_guide_lm.py`` (Lightning's FSDP2 guide under
``elan_fsdp``, gradient accumulation over 2 batches, clipping) launched on 3 workers with a fourth joining at step 4;
per seed one random worker gets SIGKILL (2 in 3) or SIGTERM at a random moment 3–22 s after the launch (start-up,
the joiner's reshard, a step, a checkpoint, the end). The run must exit 0 and end with the static 3-worker run's
final checkpoint (parameters and Adam states within 1e-9, the same step). Where the victim was is read with
``py-spy dump`` before the signal; a run that outlives 400 s is hung (every process's stacks in ``stacks.txt``).

    python -m tests.users.random_kills_fsdp --dir /tmp/rkf --seed 1 --seeds 10 [--sharded]

``--sharded``: the strategy writes sharded checkpoints (``state_dict_type="sharded"``: DCP's collectives in every
``ModelCheckpoint`` save); use another ``--dir`` (the static run is made once per directory).

One line per seed: the signal, the victim's pid and moment, the verdict, the victim's innermost frames. A seed whose
moment falls after the job ended kills nothing ("no worker to kill").
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.integration.elastic_runs import elan_env
from tests.users.corpus import assert_states_close, end_every_process_of, flat_optimizer_state, shm_dir
from tests.users.test_corpus import write_wikitext

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_guide_lm.py"
ARGS = ("--units", "layers", "--accumulate", "2", "--clip", "0.05", "--epochs", "6")
TIMEOUT_S = 400.0


def launch(home: Path, schedule: str | None, shm: Path, script_args: tuple[str, ...]) -> subprocess.Popen:
    write_wikitext(home, lines=100)
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "3", "--job", home.name,
               "--coordinate-every", "1", "--state-dir", str(home / "state"), *(["--schedule", schedule] if schedule
                                                                              else []),
               "--", sys.executable, str(SCRIPT), str(home / "out"), *script_args]
    env = {**elan_env(home), "ELAN_SHM_DIR": str(shm)}
    with (home / "output.log").open("w") as log:
        return subprocess.Popen(command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def workers() -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"^{sys.executable} {SCRIPT}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def py_spy(pid: int) -> str:
    """``py-spy dump`` of ``pid`` (where the victim was); empty where py-spy is not installed (CI's venv)."""
    executable = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(executable).exists():
        return ""
    return subprocess.run([executable, "dump", "--pid", str(pid)], capture_output=True, text=True).stdout


def run(home: Path, schedule: str | None, moment: float | None, sig: int, rng: random.Random,
        script_args: tuple[str, ...] = ARGS) -> tuple[int, str]:
    """The job to its end, ``sig`` sent to a random worker ``moment`` seconds after the launch."""
    home.mkdir(parents=True, exist_ok=True)
    shm = shm_dir(home)  # the job's shared-memory segments: a killed source cannot unlink its own
    proc, note = launch(home, schedule, shm, script_args), ""
    try:
        if moment is not None:
            time.sleep(moment)
            _, note = signal_one(home, workers(), sig, rng, moment)
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        note += stop_hung_job(home, proc, workers())
    finally:
        end_every_process_of(home)
        shutil.rmtree(shm, ignore_errors=True)
    return proc.returncode, note


def signal_one(home: Path, pids: list[int], sig: int, rng: random.Random, moment: float) -> tuple[int | None, str]:
    """``sig`` to one of ``pids`` (drawn with ``rng``), its stack first in ``HOME/victim.txt``: the victim, a note."""
    if not pids:
        return None, f"no worker to kill at {moment:.1f} s"
    victim = rng.choice(pids)
    (home / "victim.txt").write_text(py_spy(victim))
    os.kill(victim, sig)
    return victim, f"{signal.Signals(sig).name} {victim} at {moment:.1f} s"


def stop_hung_job(home: Path, proc: subprocess.Popen, pids: list[int]) -> str:
    """A job past its time: every worker's stack in ``HOME/stacks.txt``, the launcher's session SIGKILLed."""
    (home / "stacks.txt").write_text("\n".join(py_spy(pid) for pid in pids))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return " HUNG"


def final_checkpoint(home: Path) -> dict:
    """``OUT/final.ckpt``: a file (``state_dict_type="full"``), or a directory of DCP shards and ``meta.pt``
    (``"sharded"``), read whole without a process group (``dcp_to_torch_save``)."""
    path = home / "out" / "final.ckpt"
    if not path.is_dir():
        return torch.load(path, weights_only=False)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = home / "final-whole.pt"
    dcp_to_torch_save(path, whole)
    shards = torch.load(whole, weights_only=False)
    checkpoint = torch.load(path / "meta.pt", weights_only=False)
    checkpoint["state_dict"] = shards["state_dict"]
    checkpoint["optimizer_states"] = [shards[key] for key in sorted(shards) if key.startswith("optimizer_")]
    return checkpoint


def verdict(home: Path, reference: dict) -> str:
    try:
        mine = final_checkpoint(home)
        assert mine["global_step"] == reference["global_step"], (mine["global_step"], reference["global_step"])
        assert_states_close(mine["state_dict"], reference["state_dict"])
        for actual, expected in zip(mine["optimizer_states"], reference["optimizer_states"], strict=True):
            assert_states_close(flat_optimizer_state(actual), flat_optimizer_state(expected))
    except (AssertionError, FileNotFoundError) as error:
        return f"DIFF {str(error)[:200]}"
    return "ok"


def where(home: Path, count: int = 2) -> str:
    """The victim's innermost ``count`` frames (``HOME/victim.txt``, its ``py-spy dump``)."""
    path = home / "victim.txt"
    frames = [line.strip() for line in path.read_text().splitlines() if ".py:" in line] if path.exists() else []
    return " | ".join(frames[:count])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--sharded", action="store_true", help="the script's --sharded-checkpoints (DCP shards)")
    args = parser.parse_args()
    script_args = (*ARGS, "--sharded-checkpoints") if args.sharded else ARGS
    static = args.dir / "static"
    if not (static / "out" / "final.ckpt").exists():  # one --dir per form: the static run is the form's
        returncode, _ = run(static, None, None, 0, random.Random(0), script_args)
        if returncode != 0:
            raise SystemExit(f"the static run failed (exit {returncode}): {static / 'output.log'}")
    reference = final_checkpoint(static)
    for seed in range(args.seed, args.seed + args.seeds):
        rng = random.Random(seed)
        sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
        home = args.dir / f"seed{seed}"
        returncode, note = run(home, "4:add=1", rng.uniform(3, 22), sig, rng, script_args)
        outcome = verdict(home, reference) if returncode == 0 else f"EXIT {returncode}"
        print(f"seed {seed}: {note}: {outcome} :: {where(home)}", flush=True)


if __name__ == "__main__":
    main()

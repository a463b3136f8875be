"""How ``elan run`` reads its workers' exits (issue 27): only an exit the AM waited for is '(expected)'; a SIGTERM death
after another member finished training ends the job as finished, any other non-zero exit does not."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_elan.launcher.run import ExitVerdict, JobLauncher, LaunchConfig, WorkerProcess, describe_exit


@pytest.mark.parametrize(
    ("reply", "returncode", "described"),
    [
        ({"expected": True}, 0, "exited with code 0 (expected)"),
        ({"expected": False, "recovering": True, "failed_generations": [0]}, 1,
         "exited with code 1 (the job recovers without it)"),
        ({"expected": True}, -15, "was killed by SIGTERM (after the job's training completed)"),
        ({"expected": False}, 0, "exited with code 0"),
        ({"expected": False, "recovering": False}, 1, "exited with code 1"),
    ],
)
def test_only_an_exit_the_am_waited_for_is_expected(reply: dict, returncode: int, described: str) -> None:
    verdict = ExitVerdict.from_reply(reply, returncode)
    assert describe_exit(returncode, verdict.expected, verdict.note) == described
    assert verdict.tolerated == (reply.get("expected") or reply.get("recovering") or False)


def launcher_with(returncodes: dict[str, int | None]) -> JobLauncher:
    launcher = JobLauncher(LaunchConfig(job="j", nproc=len(returncodes), command=["true"], state_dir=Path("unused")))
    for worker_id, returncode in returncodes.items():
        launcher._workers[worker_id] = WorkerProcess(worker_id, "member", SimpleNamespace(pid=1), returncode=returncode)
    return launcher


def status_of(*members: str) -> dict:
    return {"members": [{"worker_id": worker_id} for worker_id in members]}


@pytest.mark.parametrize(
    ("returncodes", "finished"),
    [
        ({"w0": 0, "w1": 0}, True),
        ({"w0": 0, "w1": -15}, True),  # stopped by SIGTERM once its training loop was over
        ({"w0": 0, "w1": 143}, True),  # the same, through a shell
        ({"w0": 0, "w1": None}, False),  # still running
        ({"w0": 0, "w1": 1}, False),  # a crash is not a finish
        ({"w0": 0, "w1": -9}, False),
        ({"w0": -15, "w1": -15}, False),  # nobody shows the training complete
    ],
)
def test_the_members_finished(returncodes: dict[str, int | None], finished: bool) -> None:
    launcher = launcher_with(returncodes)
    assert launcher._members_finished(status_of(*returncodes)) is finished


def launcher_with_store(returncodes: dict[str, int | None], training_ended: list[str]) -> JobLauncher:
    """A launcher whose job store holds the marks of the members whose training loop ended."""
    import torch.distributed as dist

    from lightning_elan.protocol.contract import training_ended_key

    launcher = launcher_with(returncodes)
    launcher._store = dist.HashStore()
    for worker_id in training_ended:
        launcher._store.set(training_ended_key(worker_id), b"1")
    return launcher


@pytest.mark.parametrize(
    ("returncodes", "training_ended", "finished"),
    [
        ({"w0": 0, "w1": -9}, ["w0"], True),  # w1 killed after the last step, before its own mark (storm seed 356)
        ({"w0": 0, "w1": -9}, [], False),  # w0's exit 0 alone (a leaver's, say) does not show the training complete
        ({"w0": -9, "w1": -9}, ["w1"], True),
        ({"w0": 0, "w1": None}, ["w0"], False),  # still running
    ],
)
def test_a_death_after_another_members_training_ended_is_a_finish(returncodes: dict[str, int | None],
                                                                 training_ended: list[str], finished: bool) -> None:
    launcher = launcher_with_store(returncodes, training_ended)
    assert launcher._members_finished(status_of(*returncodes)) is finished


@pytest.mark.parametrize("training_ended", [True, False])
def test_a_death_after_the_training_ended_is_still_reported_as_a_death(training_ended: bool) -> None:
    """The other members may be in collectives after ``fit``: only the generation's failure releases them."""
    launcher = launcher_with_store({"w1": -9}, ["w1"] if training_ended else [])
    assert launcher._counted_exit(launcher._workers["w1"], -9) == -9


def test_a_death_after_a_script_failed_is_not_a_finish() -> None:
    """w1's script raised after its training (then crashed at exit): that failure fails the job, although w0's
    training loop ended."""
    from lightning_elan.protocol.contract import script_failed_key

    launcher = launcher_with_store({"w0": 0, "w1": -6}, ["w0", "w1"])
    launcher._store.set(script_failed_key("w1"), b"1")
    assert launcher._members_finished(status_of("w0", "w1")) is False

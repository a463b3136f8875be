"""A member SIGKILLed while ``ModelCheckpoint`` saves at an epoch's end, as the user sees it: an ordinary script
(``user_scripts/checkpoint_and_die.py``: float64, ``CSVLogger``, an epoch mean of the loss with ``sync_dist``,
``ModelCheckpoint`` every epoch with ``save_last``) kills itself once on rank 1, in ``on_save_checkpoint``, under
``elan run --nproc 3``. The survivors must end as the static 3-process run (the same global batches, which the two
survivors share): exit 0 (once, both survivors waited in different collectives forever), the same checkpoint files
and parameters in them, every row of ``metrics.csv`` and the final parameters within 1e-9."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.test_validation_faults import assert_same_rows
from tests.users import corpus
from tests.users.corpus import Job, Run, assert_ok, assert_states_close, run_job

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "checkpoint_and_die.py"


def job(name: str, *args: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", *args), nproc=3)


@pytest.fixture(autouse=True)
def no_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung job is killed soon (the harness's stall limit is otherwise 90 s)."""
    monkeypatch.setattr(corpus, "RUN_TIMEOUT_S", 150.0)
    monkeypatch.setattr(corpus, "STALL_S", 40.0)


@pytest.fixture(scope="module")
def static_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), job("static"))
    assert_ok(run)
    return run


@pytest.mark.parametrize("rank", [1, 2])
def test_a_death_in_the_epoch_end_save_saves_once_with_every_survivor(tmp_path: Path, static_run: Run,
                                                                      rank: int) -> None:
    """Rank ``rank`` dies in ``on_save_checkpoint`` of epoch 0's save: both survivors save again in the new
    generation (the heir, which took the dead member's epoch aggregates, does not reduce the epoch's loss again alone)
    and the job trains on to its end."""
    run = run_job(tmp_path, job("savedeath", "--die-saving", f"0:{rank}"))

    assert_ok(run)
    assert (run.out / "died").exists(), "the member never killed itself"
    assert run.output.count("a member died during ModelCheckpoint.on_train_epoch_end") == 2, run.excerpt()
    names = sorted(path.name for path in (static_run.out / "checkpoints").glob("*.ckpt"))
    assert sorted(path.name for path in (run.out / "checkpoints").glob("*.ckpt")) == names
    for name in names:
        saved = torch.load(run.out / "checkpoints" / name, weights_only=False)
        reference = torch.load(static_run.out / "checkpoints" / name, weights_only=False)
        assert (saved["epoch"], saved["global_step"]) == (reference["epoch"], reference["global_step"]), name
        assert_states_close(saved["state_dict"], reference["state_dict"])
    assert_same_rows(run.out / "logs" / "metrics.csv", static_run.out / "logs" / "metrics.csv")
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static_run.out / "final.pt"))
    assert json.loads((run.out / "final.json").read_text()) == json.loads((static_run.out / "final.json").read_text())

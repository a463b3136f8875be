"""``scripts/interval_eval_datamodule.py`` whose rank 0 SIGKILLs itself in its second ``ModelCheckpoint`` save, just
before it writes the file (``python die_in_checkpoint_save.py OUT [script arguments]``), for
``test_kill_in_checkpoint_save.py``: the others are then in ``Trainer.save_checkpoint``'s barrier at the end of a
validation run, after ``EarlyStopping`` counted that run. The script itself is unchanged; this harness wraps
``Trainer.save_checkpoint`` (``OUT/died-in-save`` names the checkpoint the victim did not write)."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

SCRIPT = Path(__file__).parent / "scripts" / "interval_eval_datamodule.py"
VICTIM_RANK, VICTIM_SAVE = 0, 2

save_checkpoint = pl.Trainer.save_checkpoint
saves = 0


def dying_save_checkpoint(trainer: pl.Trainer, filepath: Any, *args: Any, **kwargs: Any) -> None:
    global saves
    if trainer.global_rank == VICTIM_RANK and Path(filepath).parent.name == "checkpoints":
        saves += 1
        marker = Path(sys.argv[1]) / "died-in-save"
        if saves == VICTIM_SAVE and not marker.exists():
            marker.write_text(str(filepath))
            os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint(trainer, filepath, *args, **kwargs)


if __name__ == "__main__":
    pl.Trainer.save_checkpoint = dying_save_checkpoint
    sys.argv[0] = str(SCRIPT)
    runpy.run_path(str(SCRIPT), run_name="__main__")

"""A corpus script whose rank 0 SIGKILLs itself in its N-th ``ModelCheckpoint`` save (``last.ckpt`` not counted),
just before it writes the file, for ``test_kill_in_checkpoint_save.py``:

    python die_in_checkpoint_save.py N SCRIPT OUT [script arguments]

``N:last``: in the save of ``last.ckpt`` that follows its N-th save (the N-th written, the hook not done).

The others are then in ``Trainer.save_checkpoint``'s barrier, at the end of a validation run or of a training batch.
The script (``scripts/SCRIPT``) is unchanged; this harness wraps ``Trainer.save_checkpoint``. ``OUT/died-in-save``
names the checkpoint the victim did not write."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

VICTIM_RANK = 0

save_checkpoint = pl.Trainer.save_checkpoint
saves = 0


def dying_save_checkpoint(trainer: pl.Trainer, filepath: Any, *args: Any, **kwargs: Any) -> None:
    global saves
    path = Path(filepath)
    if trainer.global_rank == VICTIM_RANK and path.parent.name == "checkpoints":
        saves += path.name != "last.ckpt"
        marker = Path(sys.argv[1]) / "died-in-save"
        if saves == VICTIM_SAVE and (path.name == "last.ckpt") == IN_LAST and not marker.exists():
            marker.write_text(str(filepath))
            os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint(trainer, filepath, *args, **kwargs)


if __name__ == "__main__":
    victim_save, _, last = sys.argv.pop(1).partition(":")
    VICTIM_SAVE, IN_LAST = int(victim_save), last == "last"
    script = Path(__file__).parent / "scripts" / sys.argv.pop(1)
    pl.Trainer.save_checkpoint = dying_save_checkpoint
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")

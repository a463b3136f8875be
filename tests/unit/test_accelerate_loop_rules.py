"""What an Accelerate user's loop may do under the elastic accelerator, without a job: registered objects matched by
position whenever registered, the announcement that the job's loop ended, a standalone run's checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_elan.accelerate.loop_end import LoopEnded, LoopEndWatch, announce_loop_end, loop_ended_key
from lightning_elan.accelerate.objects import CHECKPOINTED, ReplicatedObjects


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _source(checkpointed: list[Counter], elastic: list[Counter]) -> dict:
    objects = ReplicatedObjects(lambda: checkpointed)
    objects.register_elastic(tuple(elastic))
    return objects.state_dict()


def test_a_joiner_loads_an_object_it_registers_after_receiving_the_state():
    """Registered after ``prepare()`` (where a joiner receives the state): loaded at registration, once."""
    ema, progress = Counter(7), Counter(12)
    state = _source([progress], [ema])
    checkpointed: list[Counter] = []
    joiner = ReplicatedObjects(lambda: checkpointed)
    mine_ema = Counter()
    joiner.register_elastic((mine_ema,))  # before prepare()
    joiner.load_state_dict(state)
    assert mine_ema.n == 7
    mine_progress = Counter()
    checkpointed.append(mine_progress)  # register_for_checkpointing after prepare()
    joiner.registered(CHECKPOINTED, 0)
    assert mine_progress.n == 12
    mine_progress.n = 13
    joiner.registered(CHECKPOINTED, 0)  # a received state loads once
    assert mine_progress.n == 13


def test_an_object_in_both_lists_is_sent_once_and_loaded_whichever_list_the_joiner_registers_it_in_first():
    shared = Counter(5)
    state = _source([shared], [shared])
    assert state["elastic"][0] != {"n": 5}, "sent in the checkpointed list only"
    checkpointed: list[Counter] = []
    joiner = ReplicatedObjects(lambda: checkpointed)
    mine = Counter()
    joiner.register_elastic((mine,))  # elastic before prepare(), checkpointing after
    joiner.load_state_dict(state)
    assert mine.n == 0
    checkpointed.append(mine)
    joiner.registered(CHECKPOINTED, 0)
    assert mine.n == 5


def test_objects_beyond_the_received_state_keep_their_own():
    joiner = ReplicatedObjects(lambda: [])
    joiner.load_state_dict(_source([], [Counter(3)]))
    first, extra = Counter(), Counter(9)
    joiner.register_elastic((first, extra))
    assert (first.n, extra.n) == (3, 9)


def test_an_object_without_state_dict_is_refused_with_its_type():
    with pytest.raises(ValueError, match="int has no state_dict"):
        ReplicatedObjects(lambda: []).register_elastic((3,))


def test_a_joiner_past_the_step_the_jobs_loop_ended_after_is_released_with_a_clear_error():
    """Only once it trains past the announced step of the same ``epochs()`` loop (a joiner that ends with the others
    is not stopped, nor one in a later loop of the script)."""
    store = dist.HashStore()
    steps = {"loop": 2, "now": 19}
    released = threading.Event()
    errors: list[tuple[int, LoopEnded]] = []

    def release(generation: int, error: LoopEnded) -> None:
        errors.append((generation, error))
        released.set()

    def trains_past(loop: int, ended: int, after_boundary: bool) -> bool:
        assert not after_boundary
        return steps["loop"] == loop and steps["now"] >= ended

    watch = LoopEndWatch(lambda: store, lambda: 3, trains_past, release)
    try:
        announce_loop_end(store, 3, 1, 20, False)  # the first epochs() loop ended after 20 steps, in its batch
        assert store.get(loop_ended_key(3)) == b"1:20:0"
        time.sleep(0.6)
        assert watch.ended_after == (1, 20, False)
        steps["now"] = 25  # in the second epochs() loop of the script: not past the first
        time.sleep(0.6)
        assert not released.is_set() and watch.error_if_past() is None
        steps["loop"], steps["now"] = 1, 19
        time.sleep(0.6)
        assert not released.is_set()
        steps["now"] = 20
        assert released.wait(5)
    finally:
        watch.close()
    ((generation, error),) = errors
    assert generation == 3 and error.steps == 20
    assert "accelerator.optimizer_steps" in str(error) and "accelerator.epochs(num_epochs)" in str(error)


STANDALONE_SAVES = textwrap.dedent("""
    import json, sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_elan.accelerate import ElasticAccelerator

    out = sys.argv[1]
    accelerator = ElasticAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(40, 2), torch.randn(40, 1)), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for epoch in range(1):  # a plain run (no `elan run`) may loop as it likes
        for batch, (x, y) in enumerate(data):
            with accelerator.accumulate(model):
                if batch == 8:
                    accelerator.save_state(f"{out}/before_step")  # a step of micro-batches 8, 9 is open
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if batch == 9:
                accelerator.save_state(f"{out}/after_step")  # right after the 5th step
    """)


def test_save_state_records_the_steps_applied_with_the_data_position_after_them(tmp_path: Path):
    """Right after ``optimizer.step()`` the step just applied counts (it used to be counted at the next batch, so a
    resumed job counted from one step behind); while a step is being accumulated, the checkpoint resumes at its first
    micro-batch (its gradients are not saved)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("ELAN_")}
    script = tmp_path / "saves.py"
    script.write_text(STANDALONE_SAVES)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env={**env, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert _saved_progress(tmp_path / "after_step") == (5, 20, 10)
    assert _saved_progress(tmp_path / "before_step") == (4, 16, 8)


def _saved_progress(folder: Path) -> tuple[int, int, int]:
    """``(optimizer steps, data position, Accelerate's micro-step counter)`` of a ``save_state`` folder."""
    saved = json.loads((folder / "elan_state.json").read_text())
    return saved["loop"]["optimizer_steps"], saved["data"]["position"], saved["loop"]["accelerate_step"]

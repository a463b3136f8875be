"""The GPT-2 script of the corpus with FSDP2 switched on as Accelerate's FSDP guide does it for a transformers model
(``causal_lm_gpt2.py --fsdp``: ``transformer_based_wrap`` of each ``GPT2Block``; the LM head tied to the token
embedding), static (2 workers) and under the corpus' elastic story (2 → 3, rank 0 removed, a migration, rank 1
SIGKILLed at step 9 and replaced), and at 3 workers with rank 1 SIGKILLed (the recovery's survivors seed new
mirrors). Before, the first live reshard untied ``lm_head.weight`` (the reshard made it a parameter of its own, left
on the meta device) and every member died at the grow ("Cannot copy out of meta tensor"); the recovery's reshard did
the same until it tied it too.
The elastic run must train each sample once per epoch, apply each step once and save the static run's model within
1e-9 — which is also the DDP run's model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_adjustments,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    assert_steps_applied_once,
    final_model,
    run_job,
)
from tests.users.accelerate.test_accelerate_corpus import GPT2, GROW_TO_3_AND_BACK, KILL_STEP, SCHEDULE

pytestmark = pytest.mark.integration

KILL_AT_3 = 5
"""The 3-worker job's rank 1 is SIGKILLed at this step: 2 survivors, whose recovery seeds their new mirrors."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """``runs(kind)``: the ``static`` or ``elastic`` FSDP2 run, or the ``ddp`` static run, each run once."""
    done: dict[str, Run] = {}
    jobs = {
        "static": Job("gpt2-fsdp-static", GPT2.file, ("--fsdp",)),
        "elastic": Job("gpt2-fsdp-elastic", GPT2.file, ("--fsdp",), schedule=SCHEDULE, kill_step=KILL_STEP),
        "ddp": Job("gpt2-ddp-static", GPT2.file),
        "static3": Job("gpt2-fsdp-static3", GPT2.file, ("--fsdp",), nproc=3),
        "kill3": Job("gpt2-fsdp-kill3", GPT2.file, ("--fsdp",), nproc=3, kill_step=KILL_AT_3),
        "save3": Job("gpt2-fsdp-save3", GPT2.file, ("--fsdp",), nproc=3, env=(("USERS_DIE_IN_SAVE", "3"),)),
    }

    def get(kind: str) -> Run:
        if kind not in done:
            done[kind] = run_job(Path(tmp_path_factory.mktemp(f"gpt2-{kind}")), jobs[kind])
        return done[kind]

    return get


def test_a_tied_transformers_model_under_fsdp2_trains_elastically_as_statically(runs: Callable[[str], Run]) -> None:
    static, run = runs("static"), runs("elastic")
    assert_ok(static)
    assert not static.adjustments()
    assert_ok(run)
    assert_adjustments(run, GROW_TO_3_AND_BACK)
    for one in (static, run):
        assert_each_sample_once(one.trained(), GPT2.samples, GPT2.epochs)
        assert_steps_applied_once(one.trained(), range(GPT2.steps))
    model = final_model(run)
    assert model["lm_head.weight"].equal(model["transformer.wte.weight"]), "the head is still the embedding"
    assert_states_close(model, final_model(static), where="final")


def test_fsdp2_trains_the_ddp_runs_model(runs: Callable[[str], Run]) -> None:
    static, ddp = runs("static"), runs("ddp")
    assert_ok(static)
    assert_ok(ddp)
    sharded = final_model(static)  # the full state dict names the tied head too; save_pretrained of DDP's does not
    assert_states_close({key: value for key, value in sharded.items() if key != "lm_head.weight"}, final_model(ddp),
                        where="final")


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_kill_that_leaves_two_members_of_a_tied_model_recovers_exactly(runs: Callable[[str], Run]) -> None:
    """Rank 1 of 3 SIGKILLed: the survivors restore its shard from its mirror and seed the mirrors of the new
    generation, then the replacement joins. Before, the recovery left the tied head a parameter of its own on the meta
    device, and both survivors died seeding their mirrors ("Cannot copy out of meta tensor"): the job failed."""
    static, run = runs("static3"), runs("kill3")
    assert_ok(static)
    assert_ok(run)
    assert_adjustments(run, [("failure", 2), ("add", 3)])
    assert_each_sample_once(run.trained(), GPT2.samples, GPT2.epochs)
    steps = range(len({line["step"] for line in static.trained()}))  # 3 workers: 12 samples a step
    assert_steps_applied_once(run.trained(), steps)
    model = final_model(run)
    assert model["lm_head.weight"].equal(model["transformer.wte.weight"]), "the head is still the embedding"
    assert_states_close(model, final_model(static), where="final")


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_save_state_is_recovered_and_the_checkpoint_is_whole(runs: Callable[[str], Run]) -> None:
    """Rank 1 of 3 SIGKILLed as DCP starts writing the model of the ``save_state`` after step 10 (``step_10``): the
    survivors, waiting in the write's all-reduce, recover at once (its shard from its mirror) and save again among
    themselves. Before, they raised out of ``save_state`` (the gloo connection reset) and the job failed. The
    checkpoint holds the static run's model and optimizer state; the run ends as the static one."""
    static, run = runs("static3"), runs("save3")
    assert_ok(static)
    assert_ok(run)
    died = json.loads((run.home / "observe" / "died-in-save.json").read_text())
    assert [(a["action"], a["failure"]["dead"]) for a in run.adjustments()] == [("failure", [died["worker"]])]
    assert "died in save_state; the survivors recover and save again" in run.output
    assert_each_sample_once(run.trained(), GPT2.samples, GPT2.epochs)
    assert_steps_applied_once(run.trained(), range(len({line["step"] for line in static.trained()})))
    assert_states_close(final_model(run), final_model(static), where="final")
    for checkpoint in ("step_5", "step_10", "step_15"):
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            saved, expected = (dcp_state(one.out / checkpoint / part, one.home) for one in (run, static))
            assert_states_close(saved, expected, where=f"{checkpoint}/{part}")
        position, expected = (resumes_at(one.out / checkpoint) for one in (run, static))
        assert position == expected, checkpoint


def resumes_at(checkpoint: Path) -> tuple[dict, int, int]:
    """Where a ``save_state`` checkpoint resumes: the data position, the optimizer step, Accelerate's step."""
    state = json.loads((checkpoint / "elan_state.json").read_text())
    return state["data"], state["loop"]["optimizer_steps"], state["loop"]["accelerate_step"]


def dcp_state(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint folder's tensors, flat (``dcp_to_torch_save``: no process group needed)."""
    target = scratch / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, target)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", torch.load(target, weights_only=False))
    return flat

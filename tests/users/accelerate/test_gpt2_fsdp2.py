"""The GPT-2 script of the corpus with FSDP2 switched on as Accelerate's FSDP guide does it for a transformers model
(``causal_lm_gpt2.py --fsdp``: ``transformer_based_wrap`` of each ``GPT2Block``; the LM head tied to the token
embedding), static (2 workers) and under the corpus' elastic story (2 → 3, rank 0 removed, a migration, rank 1
SIGKILLed at step 9 and replaced). Before, the first live reshard untied ``lm_head.weight`` (the reshard made it a
parameter of its own, left on the meta device) and every member died at the grow ("Cannot copy out of meta tensor").
The elastic run must train each sample once per epoch, apply each step once and save the static run's model within
1e-9 — which is also the DDP run's model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """``runs(kind)``: the ``static`` or ``elastic`` FSDP2 run, or the ``ddp`` static run, each run once."""
    done: dict[str, Run] = {}
    jobs = {
        "static": Job("gpt2-fsdp-static", GPT2.file, ("--fsdp",)),
        "elastic": Job("gpt2-fsdp-elastic", GPT2.file, ("--fsdp",), schedule=SCHEDULE, kill_step=KILL_STEP),
        "ddp": Job("gpt2-ddp-static", GPT2.file),
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

"""Lightning's FSDP2 guide, as a user runs it under ``strategy="elan_fsdp"`` (``scripts/fsdp_guide_lm.py``): the model
built on the meta device in ``configure_model`` and sharded there by the user's own ``fully_shard`` calls. It runs
static (``elan run --nproc 2``) and under the corpus' elastic schedule (2 → 3 → 2, a migration, a worker SIGKILLed as
the batch of step 12 starts, or after its optimizer step, which every member committed: its share is trained, not
recorded), and the elastic run must equal the static one: each
sample once per epoch, the final checkpoint's parameters and Adam states, every checkpoint and every logged loss within
1e-9. (Members hold different shards, so the corpus' bit-identical members check does not apply.)"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.users.corpus import (
    ADJUSTMENTS,
    FIT_OFFSET,
    KILL_STEP,
    SCHEDULE,
    Job,
    Run,
    assert_checkpoints_alike,
    assert_each_sample_once,
    assert_logged_alike,
    assert_ok,
    assert_states_close,
    checkpoints,
    flat_optimizer_state,
    logged,
    read_csv,
    run_job,
)
from tests.users.random_kills import assert_samples
from tests.users.test_corpus import write_wikitext

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("requests") is None,
                       reason="Lightning's demo WikiText2 imports requests before it looks for its data file"),
]

LINES = 100
"""Made-up WikiText lines of 34 tokens: 3400 tokens, 96 samples of 35 (the demo drops the last block): 8 global
batches of 12 per epoch, 24 steps in 3 epochs."""
SAMPLES, SAMPLES_PER_PROCESS = 96, 6


@dataclass(frozen=True)
class Variant:
    """The script's arguments, its epochs and optimizer steps, and whether it validates, predicts and fits again."""

    args: tuple[str, ...]
    epochs: int = 3
    steps: int = 24
    after_fit: bool = True


VARIANTS = {
    "layers": Variant(("--units", "layers")),
    "model": Variant(("--units", "model")),
    # FSDPStrategy's arguments: each layer a unit and activation-checkpointed, the parameters kept after the forward
    "policies": Variant(("--units", "policies"), after_fit=False),
    # each optimizer step over 2 batches, the gradients clipped to a norm of 0.05 (a norm over every member's shards)
    "accumulate": Variant(("--units", "layers", "--accumulate", "2", "--clip", "0.05"), epochs=6, after_fit=False),
}


def job(variant: str, elastic: bool, kill_phase: str) -> Job:
    spec = VARIANTS[variant]
    command = ("{scripts}/fsdp_guide_lm.py", "{out}", *spec.args, "--epochs", str(spec.epochs),
               *(("--after-fit",) if spec.after_fit else ()))
    name = f"guide-{variant}-{'elastic' if elastic else 'static'}"
    if not elastic:
        return Job(name, command)
    return Job(name, command, schedule=SCHEDULE, kill=f"{KILL_STEP}:{kill_phase}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool, str], Run]:
    done: dict[tuple[str, bool, str], Run] = {}

    def get(variant: str, elastic: bool, kill_phase: str = "start") -> Run:
        key = (variant, elastic, kill_phase if elastic else "")
        if key not in done:
            home = tmp_path_factory.mktemp(f"{variant}-{'elastic' if elastic else 'static'}")
            write_wikitext(home, lines=LINES)
            done[key] = run_job(home, job(variant, elastic, kill_phase))
        return done[key]

    return get


def final_checkpoint(run: Run) -> dict:
    return checkpoints(run.out)["final.ckpt"]


def assert_static_guide(run: Run, spec: Variant) -> None:
    assert_ok(run)
    epochs, steps = list(range(spec.epochs)), list(range(spec.steps))
    if spec.after_fit:  # and a second fit of one epoch
        epochs, steps = [*epochs, FIT_OFFSET + spec.epochs], [*steps, *range(FIT_OFFSET + spec.steps,
                                                                              FIT_OFFSET + spec.steps + 8)]
    assert_each_sample_once(run, dict.fromkeys(epochs, SAMPLES))
    assert sorted(run.digests_by_step()) == steps
    assert not run.adjustments(), "a static run has no adjustment"


@pytest.mark.parametrize(("variant", "kill_phase"), [("layers", "start"), ("model", "optimizer"),
                                                     ("accumulate", "start"), ("policies", "start")])
def test_the_guides_model_trains_elastically_as_it_trains_statically(runs: Callable[..., Run], variant: str,
                                                                       kill_phase: str) -> None:
    spec, static = VARIANTS[variant], runs(variant, False)
    assert_static_guide(static, spec)
    run = runs(variant, True, kill_phase)
    assert_ok(run)
    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == ADJUSTMENTS, adjustments
    kills = run.kills()
    assert len(kills) == 1 and adjustments[-1]["failure"]["dead"] == [kills[0]["worker"]], (kills, adjustments)
    assert_samples(run, static, "fsdp_guide_lm", {kills[0]["worker"]})  # with a share trained, not recorded
    mine, theirs = final_checkpoint(run), final_checkpoint(static)
    assert (mine["global_step"], mine["epoch"]) == (theirs["global_step"], theirs["epoch"]) == (spec.steps, spec.epochs)
    assert_states_close(mine["state_dict"], theirs["state_dict"])
    for optimizer, reference in zip(mine["optimizer_states"], theirs["optimizer_states"], strict=True):
        assert_states_close(flat_optimizer_state(optimizer), flat_optimizer_state(reference))
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
    _, rows = read_csv(run.out / "logs" / "lm" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "lm" / "version_0" / "metrics.csv")
    assert_logged_alike(rows, static_rows, "train_loss", exact=True)
    assert logged(rows, "samples_seen") == logged(static_rows, "samples_seen")
    assert sorted(logged(rows, "samples_seen").values()) == [SAMPLES] * spec.epochs, "each sample counted once"
    assert sorted(logged(static_rows, "smallest_batch").values()) == [SAMPLES_PER_PROCESS] * spec.epochs
    smallest = logged(rows, "smallest_batch").values()
    assert len(smallest) == spec.epochs and all(value in (4, 6, 12) for value in smallest), smallest  # 3, 2, 1 worker


def test_the_guides_model_is_materialised_by_the_strategy(runs: Callable[..., Run]) -> None:
    """The meta-device model gets memory and its modules' initialisation (``reset_parameters``), as under Lightning's
    ``ModelParallelStrategy``: finite, not all zero, and every layer's weights distinct from another's."""
    state = final_checkpoint(runs("layers", False))["state_dict"]
    weights = {name: value for name, value in state.items() if name.endswith("weight") and value.dim() == 2}
    assert weights and all(value.isfinite().all() and value.abs().sum() > 0 for value in weights.values())
    first, second = (state[f"model.transformer.encoder.layers.{index}.linear1.weight"] for index in (0, 1))
    assert not first.equal(second), "two layers initialised alike"


def test_the_guides_steps_are_logged_once_each(runs: Callable[..., Run]) -> None:
    run = runs("layers", True)
    _, rows = read_csv(run.out / "logs" / "lm" / "version_0" / "metrics.csv")
    steps = [int(row["step"]) for row in rows if row.get("train_loss")]
    assert sorted(steps) == list(range(VARIANTS["layers"].steps)) and len(set(steps)) == len(steps), steps


def predictions(run: Run) -> list[tuple[int, ...]]:
    """Every predicted sample's tokens, of all processes, sorted (a run at another size splits them otherwise)."""
    rows = [row for path in run.out.glob("predicted-*.pt") for batch in torch.load(path) for row in batch.view(-1, 35)]
    return sorted(tuple(row.tolist()) for row in rows)


@pytest.mark.parametrize("units", ["layers", "model"])
def test_after_fit_the_guides_model_validates_predicts_and_fits_again(runs: Callable[..., Run], units: str) -> None:
    """``validate`` and ``predict`` on the final workers, then a second ``Trainer`` (its own ``elan_fsdp`` strategy, in
    the same processes) resuming from the final checkpoint: the static run's results, predictions and final state."""
    static, run = runs(units, False), runs(units, True, "start" if units == "layers" else "optimizer")
    assert_ok(run)
    validated, expected = (json.loads((one.out / "validated.json").read_text()) for one in (run, static))
    assert abs(validated[0]["val_loss"] - expected[0]["val_loss"]) <= 1e-9, (validated, expected)
    assert len(predictions(static)) == 24 and predictions(run) == predictions(static)
    mine, theirs = (checkpoints(one.out)["final2.ckpt"] for one in (run, static))
    spec = VARIANTS[units]
    assert (mine["global_step"], mine["epoch"]) == (theirs["global_step"], theirs["epoch"]) == (spec.steps + 8,
                                                                                                spec.epochs + 1)
    assert_states_close(mine["state_dict"], theirs["state_dict"])


def test_a_job_that_only_validates_the_guides_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``trainer.validate`` with no ``fit``: the units the guide's ``configure_model`` made on the meta device are
    materialised and evaluated as they are (before, the evaluation's setup broadcast rank 0's module state over the
    sharded parameters: "Cannot flatten unevenly sharded tensor", every member died)."""
    home = tmp_path_factory.mktemp("validate-only")
    write_wikitext(home, lines=LINES)
    run = run_job(home, Job("guide-validate", ("{scripts}/fsdp_guide_lm.py", "{out}", "--validate-only")))
    assert_ok(run)
    results = [json.loads(path.read_text()) for path in sorted(run.out.glob("validated-*.json"))]
    assert len(results) == 2 and results[0] == results[1], results
    assert 0 < results[0][0]["val_loss"] < 10, results  # an NLL over a vocabulary of about 50 words, untrained


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_fsdp_strategys_arguments_make_each_layer_a_checkpointed_unit(runs: Callable[..., Run]) -> None:
    """``ElanFSDPStrategy(auto_wrap_policy=layers, activation_checkpointing_policy=layers,
    sharding_strategy="SHARD_GRAD_OP")``: the process that finished the elastic fit (through a grow, a migration and a
    recovery) has each of the 4 layers wrapped for activation checkpointing and sharded as a unit, and the
    LightningModule as the root."""
    run = runs("policies", True)
    assert_ok(run)
    layers = [f"model.transformer.{part}.layers.{index}" for part in ("encoder", "decoder") for index in (0, 1)]
    structures = [json.loads(path.read_text()) for path in run.out.glob("structure-*.json")]
    assert len(structures) == 1, structures  # the one worker left after the kill
    for structure in structures:
        assert structure["checkpointed"] == layers, structure
        assert structure["units"] == ["", *(f"{layer}._checkpoint_wrapped_module" for layer in layers)], structure

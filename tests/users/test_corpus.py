"""The corpus of ordinary user scripts (``scripts/``, see ``README.md``): each runs static (``elan run --nproc 2``)
and elastic (a grow, rank 0 leaving, a migration, a worker SIGKILLed), and the elastic run is compared with the
static one: exactly (float64, 1e-9) where the maths allows, otherwise for what must still hold."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import socket
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.users.corpus import (
    ADJUSTMENTS,
    FIT_OFFSET,
    KILL_STEP,
    SCHEDULE,
    SCRIPTS,
    TOLERANCE,
    Job,
    KnownBug,
    Run,
    assert_checkpoints_alike,
    assert_elastic,
    assert_logged_alike,
    assert_members_agree,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    assert_static,
    checkpoints,
    known_symptom,
    logged,
    read_csv,
    run_job,
    shifted,
)

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Script:
    """A script of the corpus: its command (after ``python``), whether the elastic run must equal the static run
    (``exact``), the number of samples each epoch trains, the global steps at which training batches start, and the
    phase of the elastic run's kill (``start``, or ``end`` where a kill inside ``training_step`` fails today)."""

    command: tuple[str, ...]
    exact: bool
    samples: dict[int, int]
    steps: tuple[int, ...]
    kill_phase: str = "start"

    def job(self, name: str, elastic: bool) -> Job:
        if not elastic:
            return Job(name, self.command)
        return Job(name, self.command, schedule=SCHEDULE, kill=f"{KILL_STEP}:{self.kill_phase}")


WIKITEXT_LINES, WIKITEXT_WORDS = 30, 33
WIKITEXT_SAMPLES = WIKITEXT_LINES * (WIKITEXT_WORDS + 1) // 35 - 1  # the demo's WikiText2: tokens // 35 - 1


def write_wikitext(cwd: Path, vocabulary: int = 50, lines: int = WIKITEXT_LINES) -> None:
    """What the demo's ``prepare_data`` would download, made up: ``lines`` lines of random words from a small
    vocabulary (so every 35-token sample differs), in ``./data/wikitext-2.txt`` of the job's working directory."""
    generator = random.Random(0)
    text = [" ".join(f"w{generator.randrange(vocabulary)}" for _ in range(WIKITEXT_WORDS)) for _ in range(lines)]
    (cwd / "data").mkdir(parents=True, exist_ok=True)
    (cwd / "data" / "wikitext-2.txt").write_text("\n".join(text) + "\n")


def epochs(count: int, samples: int) -> dict[int, int]:
    return dict.fromkeys(range(count), samples)


CURRICULUM_SAMPLES = {0: 48, 1: 72, 2: 96, 3: 120}
"""``curriculum_reload``: epoch e trains on the 48 + 24·e easiest samples; its callback stops training after epoch 3."""

SKIPPED_SAMPLES = {0: 72, 1: 96, 2: 36}
"""``skip_rest_timer_rich``: its ``on_train_batch_start`` ends epoch 0 after 6 batches and epoch 2 after 3."""

CORPUS: dict[str, Script] = {
    "datamodule_callbacks": Script(("{scripts}/datamodule_callbacks.py", "{out}", "--prepare-per-node"), True,
                                   epochs(4, 96), tuple(range(32))),
    "cli_classifier": Script(("{scripts}/cli_classifier.py", "fit", "--config", "{scripts}/cli_classifier.yaml",
                              "--trainer.strategy=elan", "--trainer.default_root_dir={out}",
                              "--trainer.logger.init_args.save_dir={out}", "--data.data_dir={out}/data"), True,
                             {0: 72, 1: 72, 2: 72, 3: 24}, tuple(range(20))),
    "gan_manual": Script(("{scripts}/gan_manual.py", "{out}"), True, epochs(2, 96), tuple(range(0, 32, 2)),
                         kill_phase="end"),
    "cnn_batchnorm_bf16": Script(("{scripts}/cnn_batchnorm_bf16.py", "{out}"), False, epochs(2, 96),
                                 tuple(range(16))),
    "compiled_regressor": Script(("{scripts}/compiled_regressor.py", "{out}"), True, epochs(2, 96),
                                 tuple(range(16))),
    "evaluate_after_fit": Script(("{scripts}/evaluate_after_fit.py", "{out}"), True, epochs(2, 96),
                                 tuple(range(16))),
    "tune_then_fit": Script(("{scripts}/tune_then_fit.py", "{out}"), True, epochs(2, 96), tuple(range(16))),
    "weighted_onecycle": Script(("{scripts}/weighted_onecycle.py", "{out}"), True, epochs(3, 96),
                                tuple(range(24))),
    "swa_average": Script(("{scripts}/swa_average.py", "{out}"), True, epochs(3, 96), tuple(range(24))),
    "ema_weights": Script(("{scripts}/ema_weights.py", "{out}"), True, epochs(3, 96), tuple(range(24))),
    "short_timeout": Script(("{scripts}/short_timeout.py", "{out}"), True, epochs(4, 96), tuple(range(32))),
    "ported_ddp_sampler": Script(("{scripts}/ported_ddp_sampler.py", "{out}"), True, epochs(3, 96),
                                 tuple(range(24))),
    "accumulate_by_epoch": Script(("{scripts}/accumulate_by_epoch.py", "{out}"), True, epochs(3, 96),
                                  tuple(range(16))),
    "plateau_early_stop": Script(("{scripts}/plateau_early_stop.py", "{out}"), True, epochs(5, 96),
                                 tuple(range(40))),
    "train_in_stages": Script(("{scripts}/train_in_stages.py", "{out}"), True,
                              {**epochs(2, 96), FIT_OFFSET: 96, FIT_OFFSET + 1: 96},
                              (*range(16), *range(FIT_OFFSET, FIT_OFFSET + 16))),
    "gather_outputs": Script(("{scripts}/gather_outputs.py", "{out}"), True, epochs(2, 96), tuple(range(24))),
    "contrastive_gather": Script(("{scripts}/contrastive_gather.py", "{out}"), True, epochs(2, 96),
                                 tuple(range(16))),
    "boring_demo": Script(("{scripts}/boring_demo.py", "{out}"), True, epochs(2, 64), tuple(range(64))),
    "finetune_backbone": Script(("{scripts}/finetune_backbone.py", "{out}"), True, epochs(3, 96), tuple(range(24))),
    "prune_weights": Script(("{scripts}/prune_weights.py", "{out}"), True, epochs(3, 96), tuple(range(24))),
    "metrics_loggers_profiler": Script(("{scripts}/metrics_loggers_profiler.py", "{out}"), True,
                                       {**epochs(3, 108), 3: 36}, tuple(range(30))),
    "split_barriers_resume": Script(("{scripts}/split_barriers_resume.py", "{out}"), True, epochs(2, 96),
                                    tuple(range(16))),
    "transformer_cli": Script(("{scripts}/transformer_cli.py", "fit", "--seed_everything=7",
                               "--trainer.strategy=elan", "--trainer.accelerator=cpu",
                               "--trainer.precision=bf16-mixed", "--trainer.max_epochs=2",
                               "--trainer.enable_progress_bar=false", "--trainer.default_root_dir={out}",
                               "--model.vocab_size=64"), False,
                              epochs(2, WIKITEXT_SAMPLES), tuple(range(2 * -(-WIKITEXT_SAMPLES // 2)))),
    # probe round 10
    # after the first closure's commit, inside L-BFGS's step; its final state is compared relatively (check_...)
    "lbfgs_closure": Script(("{scripts}/lbfgs_closure.py", "{out}"), False, epochs(2, 96), tuple(range(16)),
                            kill_phase="optimizer"),
    "fit_again_hparams": Script(("{scripts}/fit_again_hparams.py", "{out}"), True,
                                {**epochs(2, 96), FIT_OFFSET + 2: 96, FIT_OFFSET + 3: 96},
                                (*range(16), *range(FIT_OFFSET + 16, FIT_OFFSET + 32))),
    "overfit_batch_hooks": Script(("{scripts}/overfit_batch_hooks.py", "{out}"), True, epochs(8, 24),
                                  tuple(range(16))),
    "curriculum_reload": Script(("{scripts}/curriculum_reload.py", "{out}"), True, CURRICULUM_SAMPLES,
                                tuple(range(sum(CURRICULUM_SAMPLES.values()) // 12))),
    "subset_split_samplers": Script(("{scripts}/subset_split_samplers.py", "{out}"), True, epochs(2, 96),
                                    tuple(range(16))),
    "uneven_last_batch": Script(("{scripts}/uneven_last_batch.py", "{out}"), True, epochs(3, 101), tuple(range(27))),
    "uneven_drop_last": Script(("{scripts}/uneven_last_batch.py", "{out}", "--drop-last"), True, epochs(3, 96),
                               tuple(range(24))),
    "epoch_start_collectives": Script(("{scripts}/epoch_start_collectives.py", "{out}"), True, epochs(3, 96),
                                      tuple(range(24))),
    "fit_bounds_collectives": Script(("{scripts}/fit_bounds_collectives.py", "{out}"), True, epochs(3, 96),
                                     tuple(range(24))),
    # the batch whose hook returns -1 starts (the observer sees its start: step 17 in epoch 2) but is not trained
    "skip_rest_timer_rich": Script(("{scripts}/skip_rest_timer_rich.py", "{out}"), True, SKIPPED_SAMPLES,
                                   tuple(range(sum(SKIPPED_SAMPLES.values()) // 12 + 1))),
    # probe round 11
    "glue_transformer": Script(("{scripts}/glue_transformer.py", "{out}"), True, epochs(3, 96), tuple(range(24))),
}
XFAIL_ELASTIC: dict[str, tuple[str, str]] = {}  # script: (the bug, the symptom its elastic run prints)


def known_bug(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, raises=KnownBug, reason=f"library bug: {reason}")


def corpus_params(xfails: dict[str, tuple[str, str]]) -> list[object]:
    return [pytest.param(name, marks=known_bug(xfails[name][0])) if name in xfails else name for name in CORPUS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Run]:
    """``runs(name, elastic)``: that run of a corpus script, run once per module (the static runs are the
    references of the elastic ones). torch.compile's cache is the module's own: nothing is left outside it."""
    done: dict[tuple[str, bool], Run] = {}
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache"))}

    def get(name: str, elastic: bool) -> Run:
        if (name, elastic) not in done:
            if name == "transformer_cli" and importlib.util.find_spec("requests") is None:
                pytest.skip("Lightning's demo transformer imports requests before it looks for its data file")
            home = tmp_path_factory.mktemp(f"{name}-{'elastic' if elastic else 'static'}")
            if name == "transformer_cli":
                write_wikitext(home)
            done[name, elastic] = run_job(home, CORPUS[name].job(name, elastic), env)
        return done[name, elastic]

    return get


@pytest.mark.every_case  # the corpus: each script in the CI tier
@pytest.mark.parametrize("name", corpus_params({}))
def test_static_run(runs: Callable[[str, bool], Run], name: str) -> None:
    script, run = CORPUS[name], runs(name, False)
    assert_static(run, script.samples, list(script.steps))
    OUTPUT_CHECKS[name](run, None)


@pytest.mark.every_case  # the corpus: each script in the CI tier
@pytest.mark.parametrize("name", corpus_params(XFAIL_ELASTIC))
def test_elastic_run(runs: Callable[[str, bool], Run], name: str) -> None:
    script, static = CORPUS[name], runs(name, False)
    assert_static(static, script.samples, list(script.steps))
    run = runs(name, True)
    if name in XFAIL_ELASTIC:
        known_symptom(run, XFAIL_ELASTIC[name][1])
    assert_elastic(run, static, script.exact)
    OUTPUT_CHECKS[name](run, static)


@pytest.mark.every_case  # the corpus: each script in the CI tier
@pytest.mark.parametrize("name", ["datamodule_callbacks", "cli_classifier"])
def test_prepare_data_runs_once_on_one_host(runs: Callable[[str, bool], Run], name: str) -> None:
    """One host: ``prepare_data`` runs in one process, per node (``datamodule_callbacks``) or for the job
    (``cli_classifier``). Each call appends its pid to ``data/prepared.log``."""
    run = runs(name, False)
    assert_ok(run)
    calls = (run.out / "data" / "prepared.log").read_text().split()
    assert len(calls) == 1, f"prepare_data ran in {len(calls)} processes"


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "joiner_and_kill"])
def test_fast_dev_run(tmp_path: Path, elastic: bool) -> None:
    """``--trainer.fast_dev_run=5`` (Lightning swaps the loggers for a ``DummyLogger``, whose every attribute is a
    local function: before, the start's broadcast of the logger versions could not pickle it and every worker died):
    5 batches trained once each, nothing logged or checkpointed; elastic: a joiner at step 2, a member killed at 3."""
    command = (*CORPUS["cli_classifier"].command, "--trainer.fast_dev_run=5")
    job = Job("fast_dev_run", command, schedule="2:add=1" if elastic else None, kill="3:start" if elastic else None)
    run = run_job(tmp_path, job)
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    samples = run.samples_per_epoch()
    assert list(samples) == [0] and sum(samples[0].values()) == 5 * 12 and set(samples[0].values()) == {1}, samples
    assert not list(run.out.rglob("*.ckpt")) and not list(run.out.rglob("metrics.csv"))
    if elastic:
        assert [a["action"] for a in run.adjustments()] == ["add", "failure"], run.adjustments()


def test_a_redone_step_is_logged_once(runs: Callable[[str, bool], Run]) -> None:
    """``LearningRateMonitor`` logs in ``on_train_batch_start``, which the killed step's first attempt ran too: the
    discarded attempt's row is not written (``logged`` fails on a step logged twice)."""
    run = runs("datamodule_callbacks", True)
    assert_ok(run)
    _, rows = read_csv(run.out / "logs" / "regression" / "version_0" / "metrics.csv")
    lr_steps = [int(row["step"]) for row in rows if row["lr-Adam"]]
    assert lr_steps.count(KILL_STEP) == 1, lr_steps
    logged(rows, "lr-Adam")


def test_epoch_aggregates_match_the_static_run(runs: Callable[[str, bool], Run]) -> None:
    """``self.log(on_epoch=True, sync_dist=True)`` and a logged torchmetrics metric, in epochs where members joined,
    left (rank 0 among them), migrated and died: each epoch's value is the static run's (the departed members' parts
    were handed to a member that stayed)."""
    run, static = runs("datamodule_callbacks", True), runs("datamodule_callbacks", False)
    assert_ok(run)
    _, rows = read_csv(run.out / "logs" / "regression" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "regression" / "version_0" / "metrics.csv")
    for column in ("train_loss_epoch", "train_mse"):
        assert_logged_alike(rows, static_rows, column, exact=True)


def test_a_whole_migration_hands_the_epoch_aggregates_to_the_joiner(tmp_path: Path) -> None:
    """One worker migrates (no old member stays: the joiner takes the leaver's part of the epoch), a second joins,
    rank 0 leaves, and the one left migrates in the second epoch (the joiner takes the part in ``strategy.setup``,
    before Lightning restores its loops): every epoch's ``train_loss_epoch`` and ``train_mse`` are those of a
    one-process run."""
    command = CORPUS["datamodule_callbacks"].command
    static = run_job(tmp_path / "static", Job("dm_alone", command, nproc=1))
    run = run_job(tmp_path / "moved", Job("dm_moved", command, nproc=1,
                                          schedule="3:migrate=1,6:add=1,9:remove=rank:0,20:migrate=1"))
    assert_ok(static)
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("migrate", 1), ("add", 2),
                                                                                 ("remove", 1), ("migrate", 1)]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    _, rows = read_csv(run.out / "logs" / "regression" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "regression" / "version_0" / "metrics.csv")
    for column in ("train_loss_epoch", "train_mse", "train_loss_step"):
        assert_logged_alike(rows, static_rows, column, exact=True)


@pytest.mark.parametrize("phase", ["start", "optimizer"])
def test_manual_optimization_redoes_a_step_cut_by_a_death(runs: Callable[[str, bool], Run], tmp_path: Path,
                                                          phase: str) -> None:
    """The GAN loses its rank 1 in the batch that starts at step 4 — as the batch starts (``start``: the survivor
    meets the death inside ``training_step``, within ``toggle_optimizer``) or at the batch's first optimizer step,
    which every member committed (``optimizer``: the survivor applies the discriminator's step and meets the death in
    the generator's) — and goes on alone: it must end where the static run ends."""
    static = runs("gan_manual", False)
    run = run_job(tmp_path, Job("gan_kill", CORPUS["gan_manual"].command, kill=f"4:{phase}"))
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())


def test_a_death_in_the_first_lbfgs_step_redoes_it_from_an_untouched_optimizer(runs: Callable[[str, bool], Run],
                                                                                tmp_path: Path) -> None:
    """``lbfgs_closure.py`` loses its rank 1 as the job's first batch starts: the survivor meets the death in the
    first closure evaluation of L-BFGS's first step, after ``LBFGS.step`` began filling its state. The redo starts from
    the optimizer state the step began with (the digest of parameters and optimizer state at step 0 is the static
    run's), and the run ends where the static run ends."""
    static = runs("lbfgs_closure", False)
    run = run_job(tmp_path, Job("lbfgs_first_step", CORPUS["lbfgs_closure"].command, kill="0:start"))
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert run.digests_by_step()[0] == static.digests_by_step()[0]
    assert_members_agree(run)
    assert_same_samples(run, static)
    check_lbfgs_closure(run, static)


@pytest.mark.parametrize("step", [6, 17])
def test_a_death_as_a_skipped_batch_starts_ends_its_epoch_as_the_static_run(runs: Callable[[str, bool], Run],
                                                                            tmp_path: Path, step: int) -> None:
    """``skip_rest_timer_rich.py`` loses its rank 1 as the batch whose ``on_train_batch_start`` returns -1 starts (6:
    epoch 0's, the next epoch follows; 17: the last epoch's, ``fit`` ends): the survivor meets the death in the
    epoch's end (the ``sync_dist`` reduction of its largest error), recovers, and ends the epoch and the job as the
    static run does: every sample once, every step's loss and every epoch's logged value the static run's."""
    static = runs("skip_rest_timer_rich", False)
    run = run_job(tmp_path, Job(f"skipped_batch_kill_{step}", CORPUS["skip_rest_timer_rich"].command,
                                kill=f"{step}:start"))
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert_members_agree(run)
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_skip_rest_timer_rich(run, static)


def test_a_death_as_the_batch_end_hooks_begin_is_met_apart_and_recovered(runs: Callable[[str, bool], Run],
                                                                         tmp_path: Path) -> None:
    """``skip_rest_timer_rich.py`` grows to 3 workers at step 3, and its rank 1 dies as the ``on_train_batch_end``
    hooks of step 5 begin: the survivors meet the death in the broadcast of the ``Timer``'s stop decision, recover
    inside it (the broadcast runs again in the new generation, the hook goes on), and the job ends where the static
    run ends. (A receiver may complete the broadcast while its source fails, and meet the death at the batch boundary:
    then it runs the broadcast again with the source, ``elastic/pre_loop.py``; before, the source ran the hook again
    alone while the receiver trained the next batch, and the job hung: random kills, seed 601. That timing is not
    chosen here; ``tests/unit/test_pre_loop.py`` covers the replay.)"""
    static = runs("skip_rest_timer_rich", False)
    run = run_job(tmp_path, Job("apart_in_batch_end_hooks", CORPUS["skip_rest_timer_rich"].command,
                                schedule="3:add=1", kill="5:hooks"))
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("failure", 2)]
    assert_members_agree(run)
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_skip_rest_timer_rich(run, static)


@pytest.mark.parametrize("kill", ["0:train_start", "0:epoch_start", "8:epoch_start", "24:train_end"])
def test_a_death_where_the_training_or_an_epoch_begins_is_recovered(runs: Callable[[str, bool], Run], tmp_path: Path,
                                                                    kill: str) -> None:
    """``epoch_start_collectives.py`` loses its rank 1 as the LightningModule's ``on_train_start`` begins (the
    survivor meets the death in the reduction of the data statistics, and the hook runs again over the survivor's
    share: the whole set), or as the first or second epoch's ``on_train_epoch_start`` hooks begin (the survivor meets
    it in the broadcast of the epoch's seed), or as the ``on_train_end`` hooks begin (the survivor meets it in the
    module's barrier after rank 0 wrote its summary): the job goes on alone and ends where the static run ends."""
    static = runs("epoch_start_collectives", False)
    run = run_job(tmp_path, Job(f"begin_kill_{kill.replace(':', '_')}", CORPUS["epoch_start_collectives"].command,
                                kill=kill))
    assert_ok(run)
    assert [kill["phase"] for kill in run.kills()] == [kill.partition(":")[2]]
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert_members_agree(run)
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_epoch_start_collectives(run, static)


def test_a_death_in_an_epoch_end_hook_that_cleared_its_outputs_first_is_recovered(runs: Callable[[str, bool], Run],
                                                                                   tmp_path: Path) -> None:
    """``gather_outputs.py`` loses its rank 1 as epoch 0's ``on_train_epoch_end`` hooks begin: the survivor meets the
    death in the LightningModule's ``torch.distributed.all_reduce``, after the hook cleared its list of the epoch's
    losses, and the hook runs again with the list as it began (it raised ``stack expects a non-empty TensorList``:
    the job failed). Epoch 0's row holds the survivor's 12 losses; the run is the static run's."""
    static = runs("gather_outputs", False)
    run = run_job(tmp_path, Job("epoch_end_kill", CORPUS["gather_outputs"].command, kill="11:epoch_end"))
    assert_ok(run)
    assert [(kill["step"], kill["phase"]) for kill in run.kills()] == [(11, "epoch_end")]
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert "a member died during Model.on_train_epoch_end" in run.output
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_gather_outputs(run, static)
    gathered = [json.loads(line) for line in (run.out / "gathered.jsonl").read_text().splitlines()]
    assert [(entry["shape"], entry["steps"]) for entry in gathered] == [([1, 12], 12), ([1, 12], 12)], gathered


def test_a_joiner_takes_the_results_of_a_start_hook_run_again(runs: Callable[[str, bool], Run],
                                                               tmp_path: Path) -> None:
    """``fit_bounds_collectives.py`` loses its rank 1 as ``on_train_start`` begins: the survivor's hook runs again
    alone (its reduction and its direct ``all_reduce`` then cover the whole set), and a worker joins at step 3. The
    joiner takes the results of the hook's second run, and the job ends where the static run ends."""
    static = runs("fit_bounds_collectives", False)
    run = run_job(tmp_path, Job("fit_bounds_start_kill", CORPUS["fit_bounds_collectives"].command, schedule="3:add=1",
                                kill="0:train_start"))
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1), ("add", 2)]
    assert_members_agree(run)
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    summary, leavers = fit_bounds_summary(run)
    assert summary["processes"] == 2 and not leavers, leavers
    assert_fit_bounds_alike(run, static)


def test_a_death_in_a_validation_on_the_averaged_weights_swaps_them_back(runs: Callable[[str, bool], Run],
                                                                       tmp_path: Path) -> None:
    """``ema_weights.py`` loses its rank 1 in the validation after step 3, which ``EMAWeightAveraging`` runs on the
    average (swapped into the model as the run starts, back as it ends): the survivor abandons the run with the
    average in the model and runs it again. The average is swapped back first (before, the second run swapped it
    out again and training went on from the average: a final state 5e-2 from the static run's, exit 0)."""
    static = runs("ema_weights", False)
    run = run_job(tmp_path, Job("ema_validation_kill", CORPUS["ema_weights"].command, kill="3:validation"))
    assert_ok(run)
    assert [kill["phase"] for kill in run.kills()] == ["validation"]
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_ema_weights(run, static)


def test_a_member_killed_before_the_training_loop_changes_nothing(runs: Callable[[str, bool], Run],
                                                                   tmp_path: Path) -> None:
    """The DataModule script loses its rank 1 in the callbacks' ``setup`` (after its ``prepare_data`` wrote the
    files, before ``ModelCheckpoint`` broadcasts its directory and Lightning's ``post_setup`` barrier): the survivor
    trains the whole job alone and ends where the static run ends — its logs and checkpoints included."""
    static = runs("datamodule_callbacks", False)
    run = run_job(tmp_path, Job("dm_setup_kill", CORPUS["datamodule_callbacks"].command, kill="setup"))
    assert_ok(run)
    assert [kill["phase"] for kill in run.kills()] == ["setup"]
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert_same_samples(run, static)
    assert assert_members_agree(run) == sorted(static.digests_by_step())
    assert_states_close(run.final_state(), static.final_state())
    check_datamodule_callbacks(run, static)


# ---------------------------------------------------------------------- each script's own outputs


def check_datamodule_callbacks(run: Run, static: Run | None) -> None:
    assert (run.out / "data" / "prepared.log").read_text().split(), "prepare_data ran"
    header, rows = read_csv(run.out / "logs" / "regression" / "version_0" / "metrics.csv")
    expected = {"train_loss_step", "train_loss_epoch", "train_mse", "val_loss", "val_mse", "val_r2", "lr-Adam"}
    assert expected <= set(header), header
    assert sorted(logged(rows, "train_loss_step")) == list(range(32)), "every step logged once"
    assert len(logged(rows, "val_loss")) == 4, "EarlyStopping ended fit after the 4th of 6 epochs"
    names = sorted(path.name for path in (run.out / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in names and len(names) == 3, names  # save_top_k=2, and last
    if static is None:
        return
    _, static_rows = read_csv(static.out / "logs" / "regression" / "version_0" / "metrics.csv")
    for column in ("train_loss_step", "val_loss", "val_mse", "val_r2"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    assert_logged_alike(rows, static_rows, "lr-Adam", exact=True)
    for column in ("train_loss_epoch", "train_mse"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    saved = assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
    assert saved["last.ckpt"]["global_step"] == 32


def check_cli_classifier(run: Run, static: Run | None) -> None:
    logs = run.out / "cli" / "version_0"
    assert (logs / "config.yaml").exists(), "LightningCLI saved the config"
    header, rows = read_csv(logs / "metrics.csv")
    assert {"train_loss", "train_acc", "val_loss", "val_acc", "val_f1"} <= set(header), header
    assert sorted(logged(rows, "train_loss")) == list(range(20)), "max_steps=20"
    assert len(logged(rows, "val_loss")) == 2, "validation at batches 3 and 6 of the second epoch only"
    # the default ModelCheckpoint saves after each validation; the last one ran at step 12
    assert [path.name for path in (logs / "checkpoints").glob("*.ckpt")] == ["epoch=1-step=12.ckpt"]
    if static is None:
        return
    static_logs = static.out / "cli" / "version_0"
    _, static_rows = read_csv(static_logs / "metrics.csv")
    for column in ("train_loss", "val_loss", "val_acc", "val_f1"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    assert_logged_alike(rows, static_rows, "train_acc", exact=True)
    assert_checkpoints_alike(logs / "checkpoints", static_logs / "checkpoints", exact=True)


def check_gan_manual(run: Run, static: Run | None) -> None:
    header, rows = read_csv(run.out / "logs" / "gan" / "version_0" / "metrics.csv")
    assert {"d_loss", "g_loss", "d_real_acc"} <= set(header), header
    assert len(logged(rows, "d_loss")) == 16, "one row per batch (two optimizer steps)"
    assert sorted(path.name for path in (run.out / "checkpoints").glob("*.ckpt"))[-1] == "epoch=1-step=32.ckpt"
    if static is None:
        return
    _, static_rows = read_csv(static.out / "logs" / "gan" / "version_0" / "metrics.csv")
    for column in ("d_loss", "g_loss", "d_real_acc"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


def check_cnn_batchnorm_bf16(run: Run, static: Run | None) -> None:
    _, rows = read_csv(run.out / "logs" / "cnn" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    assert len(logged(rows, "val_acc")) == 2, "one validation per epoch"
    if static is None:
        return
    _, static_rows = read_csv(static.out / "logs" / "cnn" / "version_0" / "metrics.csv")
    for column in ("train_loss", "val_loss", "val_acc"):
        assert_logged_alike(rows, static_rows, column, exact=False)
    saved = assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=False)
    # with every_n_train_steps, Lightning writes last.ckpt at those steps only (the static run's is at step 15 of 16)
    latest = max((saved[name] for name in saved if name != "last.ckpt"), key=lambda saved_: saved_["global_step"])
    for name, value in saved["last.ckpt"]["state_dict"].items():
        assert torch.equal(value, latest["state_dict"][name]), f"last.ckpt holds the latest checkpoint's {name}"


def check_compiled_regressor(run: Run, static: Run | None) -> None:
    _, rows = read_csv(run.out / "logs" / "compiled" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "compiled" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)


def check_evaluate_after_fit(run: Run, static: Run | None) -> None:
    results = json.loads((run.out / "after_fit.json").read_text())
    indices = sorted(i for i, _ in predicted(run))
    assert indices == list(range(36)), f"every sample predicted once over the processes (as DDP shards it): {indices}"
    if static is None:
        return
    reference = json.loads((static.out / "after_fit.json").read_text())
    for stage in ("validate", "test"):
        for key, value in reference[stage][0].items():
            assert abs(results[stage][0][key] - value) <= TOLERANCE, f"{stage}: {key}"
    expected = dict(predicted(static))
    for index, value in predicted(run):
        assert abs(value - expected[index]) <= TOLERANCE, f"prediction of sample {index}"


def check_tune_then_fit(run: Run, static: Run | None) -> None:
    """Every process of the job, joiners included, saw the launch members' baseline validation and LR suggestion
    before its ``fit`` (a joiner validates alone and takes the members' range test), and the model trained with it."""
    before = json.loads((run.out / "before_fit.json").read_text())
    starts = [json.loads(path.read_text()) for path in sorted((run.out / "starts").glob("*.json"))]
    assert len(starts) == (2 if static is None else 4), "one start per process: 2 members (+ 2 joiners)"
    for start in starts:
        assert start["suggestion"] == before["suggestion"] == start["lr"]
        assert start["losses"] == before["losses"]
        assert abs(start["baseline"][0]["val_loss"] - before["baseline"][0]["val_loss"]) <= TOLERANCE
    if static is None:
        return
    reference = json.loads((static.out / "before_fit.json").read_text())
    assert before["suggestion"] == reference["suggestion"]
    assert abs(before["baseline"][0]["val_loss"] - reference["baseline"][0]["val_loss"]) <= TOLERANCE
    after = json.loads((run.out / "after_fit.json").read_text())["validate"][0]["val_loss"]
    assert abs(after - json.loads((static.out / "after_fit.json").read_text())["validate"][0]["val_loss"]) <= TOLERANCE


def check_weighted_onecycle(run: Run, static: Run | None) -> None:
    """Every step's loss and learning rate logged once; the elastic run's are the static run's (a joiner visits the
    epochs in the order the members' sampler draws)."""
    _, rows = read_csv(run.out / "logs" / "weighted" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "lr-AdamW")) == list(range(24))
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "weighted" / "version_0" / "metrics.csv")
        for column in ("train_loss", "lr-AdamW"):
            assert_logged_alike(rows, static_rows, column, exact=True)


def check_ported_ddp_sampler(run: Run, static: Run | None) -> None:
    """Every step's loss logged once; the elastic run's are the static run's (the epochs visit the sampler's global
    order, whatever the world)."""
    _, rows = read_csv(run.out / "logs" / "ported" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(24))
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "ported" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)


def check_swa_average(run: Run, static: Run | None) -> None:
    """The averaged model validates as the static run's (the final state is the average: checked with it)."""
    validated = json.loads((run.out / "averaged.json").read_text())["validate"][0]["val_loss"]
    if static is not None:
        expected = json.loads((static.out / "averaged.json").read_text())["validate"][0]["val_loss"]
        assert abs(validated - expected) <= TOLERANCE


def check_ema_weights(run: Run, static: Run | None) -> None:
    """Every step's loss logged once; with the static run: every logged loss, every checkpoint (each holds the
    average as its ``state_dict`` and the trained weights as ``current_model_state``) and the averaged model's
    validation after ``fit`` equal (the final state is the average: checked with it)."""
    _, rows = read_csv(run.out / "logs" / "ema" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(24)), "every step logged once"
    assert len(logged(rows, "val_loss")) == 7, "a validation after every 4 batches, and one after fit"
    if static is None:
        return
    _, static_rows = read_csv(static.out / "logs" / "ema" / "version_0" / "metrics.csv")
    for column in ("train_loss", "val_loss"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    saved = assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
    reference = checkpoints(static.out / "checkpoints")
    for name, checkpoint in saved.items():
        assert_states_close(checkpoint["current_model_state"], reference[name]["current_model_state"])
    validated = json.loads((run.out / "ema.json").read_text())["validate"][0]["val_loss"]
    expected = json.loads((static.out / "ema.json").read_text())["validate"][0]["val_loss"]
    assert abs(validated - expected) <= TOLERANCE, (validated, expected)


def check_short_timeout(run: Run, static: Run | None) -> None:
    """Every step's loss logged once, with the static run's values."""
    _, rows = read_csv(run.out / "logs" / "ridges" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(32)), "every step logged once"
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "ridges" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)


def check_accumulate_by_epoch(run: Run, static: Run | None) -> None:
    """Every optimizer step's loss logged once (8 in the first epoch, 4 in each later one) with the static run's
    values (a joiner in an accumulating epoch accumulates as the members do)."""
    _, rows = read_csv(run.out / "logs" / "accumulate" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "accumulate" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)


def check_plateau_early_stop(run: Run, static: Run | None) -> None:
    """EarlyStopping stopped after epoch 4 of 12; every epoch's learning rate (both schedulers') and validation loss
    are the static run's (a joiner's schedulers step at the end of the epoch it joined in, as the members' do); the
    two best checkpoints by ``val_loss`` are the static run's (a joiner monitors the validation it did not run)."""
    stopped = json.loads((run.out / "stopped.json").read_text())
    assert (stopped["stopped_epoch"], stopped["step"]) == (4, 40)
    _, rows = read_csv(run.out / "logs" / "plateau" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(40))
    assert sorted(logged(rows, "lr-SGD")) == [0, 8, 16, 24, 32]
    if static is not None:
        assert abs(stopped["lr"] - json.loads((static.out / "stopped.json").read_text())["lr"]) <= TOLERANCE
        _, static_rows = read_csv(static.out / "logs" / "plateau" / "version_0" / "metrics.csv")
        for column in ("lr-SGD", "lr-SGD-1", "val_loss"):
            assert_logged_alike(rows, static_rows, column, exact=True)
        saved = assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
        assert len(saved) == 2, sorted(saved)


def check_train_in_stages(run: Run, static: Run | None) -> None:
    """Both stages trained all their steps, each logged once; the elastic run's stages end where the static run's do
    (its first stage changed size, its second trains on the workers left)."""
    stages = json.loads((run.out / "stages.json").read_text())
    assert [stages[name]["step"] for name in ("head", "everything")] == [16, 16]
    for name in ("head", "everything"):
        _, rows = read_csv(run.out / "logs" / name / "version_0" / "metrics.csv")
        assert sorted(logged(rows, "train_loss")) == list(range(16)), name
        if static is not None:
            _, static_rows = read_csv(static.out / "logs" / name / "version_0" / "metrics.csv")
            assert_logged_alike(rows, static_rows, "train_loss", exact=True)
    if static is not None:
        reference = json.loads((static.out / "stages.json").read_text())
        for name in ("head", "everything"):
            value, expected = stages[name]["validate"][0]["val_loss"], reference[name]["validate"][0]["val_loss"]
            assert abs(value - expected) <= TOLERANCE, name


def test_a_joiner_of_the_first_stage_trains_the_second_with_the_members(runs: Callable[[str, bool], Run],
                                                                          tmp_path: Path) -> None:
    """``train_in_stages`` with a worker joining in the first stage (step 3) and staying: the second stage (a new
    ``Trainer``, not elastic) trains on the 3 workers with the global batch its loader means at the job's launch
    world (6 per process × 2), each sample once per epoch, ranks bit-identical, as the static run. (The joiner used
    its own world for that: 6 × 3, trained samples the members trained too, and the job hung.)"""
    static = runs("train_in_stages", False)
    assert_ok(static)
    run = run_job(tmp_path, Job("stagesjoin", CORPUS["train_in_stages"].command, schedule="3:add=1"))
    assert_ok(run)
    assert [(a["action"], a["step"], len(a["members"])) for a in run.adjustments()] == [("add", 3, 3)]
    assert_same_samples(run, static)
    assert assert_members_agree(run) == sorted(static.digests_by_step())
    assert_states_close(run.final_state(), static.final_state())
    check_train_in_stages(run, static)


def predicted(run: Run) -> list[tuple[int, float]]:
    """(sample index, prediction) of every prediction any process wrote."""
    pairs = []
    for path in sorted((run.out / "predictions").glob("rank-*.pt")):
        written = torch.load(path)
        pairs += zip(written["index"].tolist(), written["prediction"].squeeze(1).tolist(), strict=True)
    return pairs


def check_transformer_cli(run: Run, static: Run | None) -> None:
    directory = run.out / "lightning_logs" / "version_0" / "checkpoints"
    last = f"epoch=1-step={len(CORPUS['transformer_cli'].steps)}.ckpt"
    assert [path.name for path in directory.glob("*.ckpt")] == [last]
    if static is not None:
        assert_checkpoints_alike(directory, static.out / "lightning_logs" / "version_0" / "checkpoints", False)


def check_gather_outputs(run: Run, static: Run | None) -> None:
    """Every epoch's gathered losses reached rank 0, one row per process of the moment, finite (the elastic run's
    processes hold different numbers of losses after a join, and uneven shares of a global batch at 3 workers)."""
    lines = (run.out / "gathered.jsonl").read_text().splitlines()
    gathered = [json.loads(line) for line in lines]
    assert [entry["epoch"] for entry in gathered] == [0, 1], gathered
    for entry in gathered:
        assert math.isfinite(entry["mean"]) and entry["shape"][1] >= 12 and entry["steps"] >= 12, entry
    if static is None:
        assert [(entry["shape"], entry["steps"]) for entry in gathered] == [([2, 12], 24), ([2, 12], 24)]


def check_contrastive_gather(run: Run, static: Run | None) -> None:
    """Rank 0's epoch loss (a mean over the epoch's batches of the gathered contrastive loss) each epoch, the static
    run's: a batch redone after the kill (its gradients came back through the gather) counted once."""
    epochs_logged = [json.loads(line) for line in (run.out / "epochs.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in epochs_logged] == [0, 1], epochs_logged
    if static is not None:
        reference = [json.loads(line) for line in (static.out / "epochs.jsonl").read_text().splitlines()]
        for entry, expected in zip(epochs_logged, reference, strict=True):
            assert math.isclose(entry["loss"], expected["loss"], rel_tol=0, abs_tol=TOLERANCE), (entry, expected)


def check_boring_demo(run: Run, static: Run | None) -> None:
    """Validation twice an epoch (after 16 and 32 of the 32 batches), on the data ``val_dataloader`` made: a joiner
    builds the members' validation data too."""
    _, rows = read_csv(run.out / "logs" / "boring" / "version_0" / "metrics.csv")
    assert len(logged(rows, "val_loss")) == 4, "validation after 16 and 32 batches of each epoch"
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "boring" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "val_loss", exact=True)


def check_finetune_backbone(run: Run, static: Run | None) -> None:
    """The backbone joins the optimizer at epoch 1 as a second group (its learning rate raised 1.5× each epoch
    after): both groups' learning rates logged at every step from then on, the static run's; the parameters (checked
    with the others) show the backbone trained on the all-reduced gradient: the migration's joiner (step 9) took
    the members' unfrozen backbone, and every rank stayed equal."""
    groups = json.loads((run.out / "groups.json").read_text())
    assert [group["size"] for group in groups] == [2, 4], groups
    _, rows = read_csv(run.out / "logs" / "version_0" / "metrics.csv")
    assert len(logged(rows, "lr-Adam/pg2")) == 16, "the backbone's group from epoch 1 on: 16 steps"
    if static is not None:
        assert groups == json.loads((static.out / "groups.json").read_text())
        _, static_rows = read_csv(static.out / "logs" / "version_0" / "metrics.csv")
        for column in ("train_loss", "lr-Adam/pg1", "lr-Adam/pg2"):
            assert_logged_alike(rows, static_rows, column, exact=True)


def check_prune_weights(run: Run, static: Run | None) -> None:
    """A fifth of the remaining weights pruned at each epoch's end (the migration's joiner at step 9 came after the
    first pruning and kept its masks): the static run's sparsity, its losses and its checkpoints."""
    sparsity = json.loads((run.out / "sparsity.json").read_text())
    assert sorted(sparsity) == ["0", "2"] and all(zeros > 0 for zeros in sparsity.values()), sparsity
    _, rows = read_csv(run.out / "logs" / "version_0" / "metrics.csv")
    logged(rows, "train_loss")
    if static is not None:
        assert sparsity == json.loads((static.out / "sparsity.json").read_text())
        _, static_rows = read_csv(static.out / "logs" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)
        assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


LOGGED_COLUMNS = ("train_loss_step", "train_loss_epoch", "val_loss", "val_mse", "val_mae", "lr-Adam", "grad_norm",
                  "weight_norm")


def check_metrics_loggers_profiler(run: Run, static: Run | None) -> None:
    """``max_steps=30`` over epochs of 9 batches (``limit_train_batches=0.75`` of 12); both CSV loggers got the same
    rows, every step once, a validation twice in each whole epoch (none in the sanity check or the last 3 batches); the
    profiler's report printed;
    with the static run: every logged column and the checkpoints equal."""
    _, rows = read_csv(run.out / "csv_a" / "version_0" / "metrics.csv")
    assert read_csv(run.out / "csv_b" / "version_0" / "metrics.csv")[1] == rows, "the two loggers differ"
    assert sorted(logged(rows, "train_loss_step")) == list(range(30))
    assert sorted(logged(rows, "val_mse")) == [3, 7, 12, 16, 21, 25], "after the 4th and 9th batch of epochs 0-2"
    assert "FIT Profiler Report" in run.output
    if static is not None:
        _, static_rows = read_csv(static.out / "csv_a" / "version_0" / "metrics.csv")
        for column in LOGGED_COLUMNS:
            assert_logged_alike(rows, static_rows, column, exact=True)
        assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


def check_split_barriers_resume(run: Run, static: Run | None) -> None:
    """Rank 0's summary row of each epoch written once, before every rank's barriers; the custom state carried
    through checkpoints and joins (``on_save_checkpoint``/``on_load_checkpoint``); every step logged once; with the
    static run: the loss, learning rate (scaled by the launch world) and validation loss of every step, and the
    checkpoints (``last.ckpt`` and the two best by ``train_loss``), equal."""
    summary = [json.loads(line) for line in (run.out / "summary.jsonl").read_text().splitlines()]
    assert summary == [{"epoch": 0, "step": 8}, {"epoch": 1, "step": 16}], summary
    assert json.loads((run.out / "final.json").read_text()) == {"epochs_summarised": [0, 1]}
    _, rows = read_csv(run.out / "logs" / "split" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "split" / "version_0" / "metrics.csv")
        for column in ("train_loss", "lr-SGD", "val_loss"):
            assert_logged_alike(rows, static_rows, column, exact=True)
        saved = assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
        assert len(saved) == 3, sorted(saved)


LBFGS_RELATIVE = 1e-8
"""L-BFGS amplifies rounding (its ``ro`` is 1/(y·s), about 100 here): the elastic run's final parameters were 3e-10
from the static run's and ``ro`` 6e-8 (6e-10 relative) — a mean of 2 shares against 1 whole share in the last steps."""


def check_lbfgs_closure(run: Run, static: Run | None) -> None:
    """L-BFGS evaluates the closure up to 5 times a step: every step's loss logged once; with the static run, its
    losses and the final parameters and L-BFGS state equal within ``LBFGS_RELATIVE`` of each tensor's largest value."""
    _, rows = read_csv(run.out / "logs" / "lbfgs" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    if static is not None:
        final, reference = run.final_state(), static.final_state()
        assert final.keys() == reference.keys()
        for key, value in reference.items():
            scale = max(1.0, value.double().abs().max().item()) if value.numel() else 1.0
            assert_states_close({key: final[key]}, {key: value}, atol=LBFGS_RELATIVE * scale)
        _, static_rows = read_csv(static.out / "logs" / "lbfgs" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)


def check_fit_again_hparams(run: Run, static: Run | None) -> None:
    """The second ``fit`` of the same Trainer continued from epoch 2 to 4 (16 steps each); the best checkpoint reloads
    with its hyperparameters; with the static run: every step's loss and validation loss, the checkpoint, the reloaded
    model's validation, equal."""
    result = json.loads((run.out / "result.json").read_text())
    assert (result["first_fit_steps"], result["steps"], result["epoch"]) == (16, 32, 4), result
    assert result["hparams"] == {"hidden": 16, "lr": 0.02, "head_clip": 0.05}, result
    _, rows = read_csv(run.out / "logs" / "again" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(32))
    if static is not None:
        expected = json.loads((static.out / "result.json").read_text())
        assert result["best"] == expected["best"]
        value, reference = result["validate"][0]["val_loss"], expected["validate"][0]["val_loss"]
        assert abs(value - reference) <= TOLERANCE, (value, reference)
        _, static_rows = read_csv(static.out / "logs" / "again" / "version_0" / "metrics.csv")
        for column in ("train_loss", "val_loss"):
            assert_logged_alike(rows, static_rows, column, exact=True)
        assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


def check_overfit_batch_hooks(run: Run, static: Run | None) -> None:
    """``overfit_batches=2``: 2 training and 2 validation batches per epoch, the first 24 samples in order; every step
    and validation logged once; the batch hooks ran for every batch (rank 0's count, static run)."""
    _, rows = read_csv(run.out / "logs" / "overfit" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    assert sorted(logged(rows, "val_loss")) == list(range(1, 16, 2))
    for epoch, samples in run.samples_per_epoch().items():
        assert sorted(samples) == list(range(24)), f"epoch {epoch}: {sorted(samples)}"
    hooks = json.loads((run.out / "hooks.json").read_text())
    assert hooks["steps"] == 16
    if static is None:
        assert hooks["before_transfer"] == hooks["transfer"] == hooks["after_transfer"] == 16 + 16 + 2, hooks
        return
    _, static_rows = read_csv(static.out / "logs" / "overfit" / "version_0" / "metrics.csv")
    assert_logged_alike(rows, static_rows, "train_loss", exact=True)
    # overfit_batches=2 is limit_val_batches=2 per process: 4 batches at the launch world, 6 at the 3 workers of
    # steps 3-5 (elan warns: "limit_val_batches=2 per process at 2 workers is 4 batches; at 3 workers each evaluates
    # 2 (6 in all)"), so those validations differ; the others are the static run's
    worlds = {record["step"]: record["world"] for record in run.events("start")}
    divided = {str(step) for step, world in worlds.items() if 4 % world == 0}  # a run's 3-worker steps are
    # assert_elastic's to require (a random-kill run may kill the joiner before it ever trains)
    assert_logged_alike([row for row in rows if row.get("step") in divided],
                        [row for row in static_rows if row.get("step") in divided], "val_loss", exact=True)


def check_curriculum_reload(run: Run, static: Run | None) -> None:
    """The loader rebuilt at every epoch from ``current_epoch`` (a joiner builds the members' epoch's), the callback's
    ``should_stop`` after epoch 3; with the static run: every step's loss and epoch loss equal."""
    result = json.loads((run.out / "curriculum.json").read_text())
    assert result["stopped_at"] == max(CURRICULUM_SAMPLES), result
    assert result["steps"] == sum(CURRICULUM_SAMPLES.values()) // 12, result
    _, rows = read_csv(run.out / "logs" / "curriculum" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss_step")) == list(range(result["steps"]))
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "curriculum" / "version_0" / "metrics.csv")
        for column in ("train_loss_step", "train_loss_epoch"):
            assert_logged_alike(rows, static_rows, column, exact=True)


def check_subset_split_samplers(run: Run, static: Run | None) -> None:
    """Validation through the loader's own ``SubsetRandomSampler``: each of the 24 validation samples seen once per
    validation (at 2 and 3 workers alike: 24 divides), none of the training ones; with the static run, every step's
    loss and every validation's summed error equal."""
    _, rows = read_csv(run.out / "logs" / "subset" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(16))
    assert set(logged(rows, "val_seen").values()) == {24.0}, logged(rows, "val_seen")
    assert set(logged(rows, "val_foreign").values()) == {0.0}, logged(rows, "val_foreign")
    if static is not None:
        _, static_rows = read_csv(static.out / "logs" / "subset" / "version_0" / "metrics.csv")
        for column in ("train_loss", "val_sse"):
            assert_logged_alike(rows, static_rows, column, exact=True)


def check_glue_transformer(run: Run, static: Run | None) -> None:
    """Every step's loss and LR logged once; each validation of both splits saw each of its samples once (18 and 12);
    with the static run: every step's loss, both splits' losses and accuracies, the last epoch's checkpoint."""
    logs = run.out / "logs" / "glue" / "version_0"
    _, rows = read_csv(logs / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(24))
    for split, size in (("matched", 18), ("mismatched", 12)):
        assert list(logged(rows, f"val_seen_{split}").values()) == [float(size)] * 3, logged(rows, f"val_seen_{split}")
    assert [path.name for path in (logs / "checkpoints").glob("*.ckpt")] == ["epoch=2-step=24.ckpt"]
    if static is None:
        return
    static_logs = static.out / "logs" / "glue" / "version_0"
    _, static_rows = read_csv(static_logs / "metrics.csv")
    for column in ("train_loss", "val_loss_matched", "val_acc_matched", "val_loss_mismatched", "val_acc_mismatched"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    assert_checkpoints_alike(logs / "checkpoints", static_logs / "checkpoints", exact=True)


def check_skip_rest_timer_rich(run: Run, static: Run | None) -> None:
    """The epochs cut where the hook returned -1 (on every member: no epoch trains a batch past its cut), the
    ``Timer``'s budget not spent; with the static run: every step's loss and every epoch's largest error equal."""
    result = json.loads((run.out / "skipped.json").read_text())
    assert result["steps"] == sum(SKIPPED_SAMPLES.values()) // 12, result
    assert 0 < result["elapsed"] < 2 * 3600, result
    _, rows = read_csv(run.out / "logs" / "cut" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(result["steps"]))
    assert len(logged(rows, "worst_error")) == len(SKIPPED_SAMPLES), logged(rows, "worst_error")
    if static is None:
        assert result["trained"] == {str(epoch): list(range(samples // 12)) for epoch, samples in
                                     SKIPPED_SAMPLES.items()}, result
    else:
        _, static_rows = read_csv(static.out / "logs" / "cut" / "version_0" / "metrics.csv")
        for column in ("train_loss", "worst_error"):
            assert_logged_alike(rows, static_rows, column, exact=True)


def check_uneven_last_batch(run: Run, static: Run | None) -> None:
    """Every step's loss logged once; each validation covers the 29 samples, padded to 30 as ``DistributedSampler``
    pads them at 2 and 3 processes (not at 1); with the static run: every step's loss equal, but for the short last
    batches (``self.log(sync_dist=True)`` of a step averages the processes' means: 5 samples shared 3 and 2 log
    another mean than 5 on one process; the training itself weighs each sample once)."""
    _, rows = read_csv(run.out / "logs" / "uneven" / "version_0" / "metrics.csv")
    steps = sorted(logged(rows, "train_loss"))
    assert steps == list(range(len(steps))), steps
    seen = set(logged(rows, "val_seen").values())
    assert seen <= {29.0, 30.0} and seen, seen
    if static is None:
        assert seen == {30.0}, seen
    else:
        _, static_rows = read_csv(static.out / "logs" / "uneven" / "version_0" / "metrics.csv")
        short = {str(step) for step in (8, 17, 26)} if "--drop-last" not in run.job.command else set()
        assert_logged_alike([row for row in rows if row.get("step") not in short],
                            [row for row in static_rows if row.get("step") not in short], "train_loss", exact=True)


def check_epoch_start_collectives(run: Run, static: Run | None) -> None:
    """Every epoch's seed is rank 0's draw; the statistics are those of the whole training set (the reduction of
    the processes' shares); with the static run: the same statistics and every step's loss."""
    result = json.loads((run.out / "seeds.json").read_text())
    assert result["drawn"] == {str(epoch): random.Random(1000 + epoch).randrange(1 << 30) for epoch in range(3)}
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary == {"mean": result["mean"], "std": result["std"], "steps": 24}, summary
    _, rows = read_csv(run.out / "logs" / "seeded" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(24))
    if static is None:
        y = epoch_start_targets()
        assert (result["mean"], result["std"]) == pytest.approx((y.mean().item(), y.std(unbiased=False).item()),
                                                                rel=1e-12), result
    else:
        static_result = json.loads((static.out / "seeds.json").read_text())
        assert (result["mean"], result["std"]) == (static_result["mean"], static_result["std"])
        _, static_rows = read_csv(static.out / "logs" / "seeded" / "version_0" / "metrics.csv")
        assert_logged_alike(rows, static_rows, "train_loss", exact=True)


def epoch_start_targets() -> torch.Tensor:
    """The training targets of ``epoch_start_collectives.py``, made as its dataset makes them."""
    return load_script("epoch_start_collectives").Grid(96, 2).y


def load_script(name: str) -> types.ModuleType:
    """The module of ``scripts/<name>.py`` (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def check_fit_bounds_collectives(run: Run, static: Run | None) -> None:
    """Every process has the run id rank 0 drew (a joiner took the members' broadcast in its ``on_fit_start``); the
    statistics are the whole training set's (a joiner took the members' gather and reduction, and the tensor their
    direct ``torch.distributed.all_reduce`` left: a joiner's own call hung the job); the summary counts the final
    workers; every process's ``teardown`` waited for the others and wrote what it saw: a leaver alone (a world of its
    own), the final workers together; no process printed a traceback. With the static run: the same statistics and
    every step's loss."""
    summary, leavers = fit_bounds_summary(run)
    if static is None:
        data = load_script("fit_bounds_collectives").Features(96, 2)
        assert summary["processes"] == 2 and not leavers, leavers
        assert summary["x_scale"] == data.x.abs().amax(dim=0).tolist(), summary
        assert summary["y"] == pytest.approx([data.y.mean().item(), data.y.std(unbiased=False).item()], rel=1e-12)
        return
    assert summary["processes"] == 1 and [record["steps"] for record in leavers] == [6, 9], leavers  # remove, migrate
    assert_fit_bounds_alike(run, static)


def fit_bounds_summary(run: Run) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``fit_bounds_collectives.py``'s summary and its leavers' teardown records, checked for what every run holds."""
    summary = json.loads((run.out / "summary.json").read_text())
    seen = [json.loads(path.read_text()) for path in sorted((run.out / "teardown").glob("*.json"))]
    assert {record["run_id"] for record in seen} == {summary["run_id"]}, seen
    assert {record["samples"] for record in seen} == {96}, seen  # torch.distributed.all_reduce in on_train_start
    assert {host for record in seen for host in record["hosts"]} == {socket.gethostname()}, seen  # all_gather_object
    assert summary["steps"] == 24, summary
    finals = [record for record in seen if record["steps"] == 24]
    leavers = [record for record in seen if record["steps"] < 24]
    assert len(finals) == summary["processes"] and {record["world"] for record in finals} == {len(finals)}, seen
    assert {record["world"] for record in leavers} <= {1}, seen
    assert "Traceback" not in run.output, run.excerpt()
    _, rows = read_csv(run.out / "logs" / "scaled" / "version_0" / "metrics.csv")
    assert sorted(logged(rows, "train_loss")) == list(range(24))
    return summary, leavers


def assert_fit_bounds_alike(run: Run, static: Run) -> None:
    summary, static_summary = (json.loads((r.out / "summary.json").read_text()) for r in (run, static))
    assert (summary["x_scale"], summary["y"]) == (static_summary["x_scale"], static_summary["y"]), summary
    _, rows = read_csv(run.out / "logs" / "scaled" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "scaled" / "version_0" / "metrics.csv")
    assert_logged_alike(rows, static_rows, "train_loss", exact=True)


OUTPUT_CHECKS: dict[str, Callable[[Run, Run | None], None]] = {
    "glue_transformer": check_glue_transformer,
    "epoch_start_collectives": check_epoch_start_collectives,
    "fit_bounds_collectives": check_fit_bounds_collectives,
    "datamodule_callbacks": check_datamodule_callbacks,
    "cli_classifier": check_cli_classifier,
    "gan_manual": check_gan_manual,
    "cnn_batchnorm_bf16": check_cnn_batchnorm_bf16,
    "compiled_regressor": check_compiled_regressor,
    "evaluate_after_fit": check_evaluate_after_fit,
    "tune_then_fit": check_tune_then_fit,
    "train_in_stages": check_train_in_stages,
    "swa_average": check_swa_average,
    "ema_weights": check_ema_weights,
    "short_timeout": check_short_timeout,
    "plateau_early_stop": check_plateau_early_stop,
    "accumulate_by_epoch": check_accumulate_by_epoch,
    "weighted_onecycle": check_weighted_onecycle,
    "ported_ddp_sampler": check_ported_ddp_sampler,
    "transformer_cli": check_transformer_cli,
    "boring_demo": check_boring_demo,
    "gather_outputs": check_gather_outputs,
    "contrastive_gather": check_contrastive_gather,
    "finetune_backbone": check_finetune_backbone,
    "prune_weights": check_prune_weights,
    "metrics_loggers_profiler": check_metrics_loggers_profiler,
    "split_barriers_resume": check_split_barriers_resume,
    "lbfgs_closure": check_lbfgs_closure,
    "fit_again_hparams": check_fit_again_hparams,
    "overfit_batch_hooks": check_overfit_batch_hooks,
    "curriculum_reload": check_curriculum_reload,
    "subset_split_samplers": check_subset_split_samplers,
    "skip_rest_timer_rich": check_skip_rest_timer_rich,
    "uneven_last_batch": check_uneven_last_batch,
    "uneven_drop_last": check_uneven_last_batch,
}


# ---------------------------------------------------------------------- fit(ckpt_path=...) at another world size

RESUME = ("{scripts}/resume_other_world.py", "{out}")


def test_resume_from_a_checkpoint_of_another_world_size(tmp_path: Path) -> None:
    """The classic-package script trains 2 epochs on 3 workers (batch 4: global batch 12), then a 2-worker job
    (batch 6) resumes from the last checkpoint with ``fit(ckpt_path=...)`` and runs the elastic schedule: it ends
    where a static 2-worker run of all 4 epochs ends (within 1e-9), each sample once per epoch."""
    static = run_job(tmp_path / "static", Job("resume", (*RESUME, "--batch-size", "6", "--max-epochs", "4")))
    assert_static(static, epochs(4, 96), list(range(32)))
    first = run_job(tmp_path / "first", Job("first", (*RESUME, "--batch-size", "4", "--max-epochs", "2"), nproc=3))
    assert_static(first, epochs(2, 96), list(range(16)))
    written, reference = checkpoints(first.out / "checkpoints"), checkpoints(static.out / "checkpoints")
    assert sorted(written) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]
    for name, checkpoint in written.items():
        assert_states_close(checkpoint["state_dict"], reference[name]["state_dict"])

    resumed = Job("resumed", (*RESUME, "--batch-size", "6", "--max-epochs", "4", "--resume",
                              str(first.out / "checkpoints" / "epoch=1-step=16.ckpt")),
                  schedule=shifted(SCHEDULE, 16), kill=f"{KILL_STEP + 16}:start")
    run = run_job(tmp_path / "resumed", resumed)
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == ADJUSTMENTS
    seen, expected = run.samples_per_epoch(), static.samples_per_epoch()
    assert sorted(seen) == [2, 3], "the resumed job trains epochs 2 and 3"
    for epoch in (2, 3):
        assert sorted(seen[epoch].elements()) == sorted(expected[epoch].elements()), f"epoch {epoch}"
    assert assert_members_agree(run) == list(range(16, 32))
    assert_states_close(run.final_state(), static.final_state())
    later = checkpoints(run.out / "checkpoints")
    assert sorted(later) == ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt"]
    for name, checkpoint in later.items():
        assert_states_close(checkpoint["state_dict"], reference[name]["state_dict"])


# ---------------------------------------------------------------------- what is refused at start (probe round 10)


@pytest.mark.parametrize(("command", "message"), [
    (("{scripts}/two_sources_combined.py", "{out}"), "NotImplementedError: ElanStrategy trains on one training "
                                                      "DataLoader (exactly once per epoch is kept for one dataset); "
                                                      "got 2, which Lightning combines"),
    (("{scripts}/two_sources_combined.py", "{out}", "--mode", "min_size"), "got 2, which Lightning combines"),
    (("{scripts}/bucketed_batches.py", "{out}"), "NotImplementedError: ElanStrategy's training DataLoader needs a "
                                                 "batch_size: it cuts each global batch from the epoch's order of "
                                                 "samples, and a batch_sampler (LengthBuckets)"),
    (("{scripts}/streaming_iterable.py", "{out}"), "NotImplementedError: ElanStrategy's training DataLoader needs a "
                                                   "map-style dataset (exactly once per epoch is kept by sample "
                                                   "index); an IterableDataset is not supported yet"),
], ids=["dict_of_loaders", "combined_min_size", "batch_sampler", "iterable_dataset"])
def test_a_training_loader_elan_cannot_make_elastic_stops_the_job_at_start(tmp_path: Path, command: tuple[str, ...],
                                                                           message: str) -> None:
    """Several training loaders (a dict, ``CombinedLoader``), a loader with its own ``batch_sampler`` and a streamed
    ``IterableDataset`` are refused before the first batch, on every worker, with what to do: the job ends at once
    with a failure, nothing trained."""
    started = time.monotonic()
    run = run_job(tmp_path, Job("refused", command))
    assert run.returncode != 0
    assert message in run.output, run.excerpt()
    assert not run.events("trained") and not run.events("start")
    assert time.monotonic() - started < 60, "the job ended at once"


def test_a_death_in_the_backward_of_a_gather_redoes_the_step(runs: Callable[[str, bool], Run],
                                                              tmp_path: Path) -> None:
    """``contrastive_gather.py`` (``all_gather(sync_grads=True)``: the gather's backward is a collective): rank 1
    dies as its backward of the batch at step 5 starts, so the survivor meets the death inside its own backward, in
    the gather's backward. The step is redone without it: the static run's samples, epoch losses and final state."""
    static = runs("contrastive_gather", False)
    run = run_job(tmp_path, Job("gather_backward", CORPUS["contrastive_gather"].command, kill="5:backward"))
    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_contrastive_gather(run, static)

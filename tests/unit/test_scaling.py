"""Pure scaling math: Elan's Algorithm 1 and its scale-in mirror, the limits, the policies, the throughput model."""

from __future__ import annotations

import json
import math
import random

import pytest

from lightning_elan.scaling import (
    ScalingDecision,
    ScalingLimits,
    StepTimer,
    ThroughputModel,
    format_summary,
    scale_global_batch,
    scaling_summary,
    total_batch_size,
)


class TableModel:
    """N_opt by global batch, from a table; records the trials Algorithm 1 made."""

    def __init__(self, n_opt: dict[int, int], ready: bool = True) -> None:
        self.n_opt = n_opt
        self.trials: list[int] = []
        self._ready = ready

    def optimal_workers(self, global_batch: int, candidates) -> int:
        self.trials.append(global_batch)
        return self.n_opt[global_batch]

    def ready(self) -> bool:
        return self._ready


# ---------------------------------------------------------------------- Algorithm 1 (scale-out)


def test_strong_scaling_suffices_at_k1():
    model = TableModel({128: 4})
    decision = total_batch_size(2, 128, 4, model)
    assert (decision.global_batch, decision.local_batch, decision.k) == (128, 32, 1.0)
    assert model.trials == [128]
    assert "strong scaling" in decision.reason


def test_smallest_multiple_whose_optimum_covers_the_new_workers():
    model = TableModel({128: 4, 256: 6, 512: 8})
    decision = total_batch_size(2, 128, 8, model)
    assert (decision.global_batch, decision.local_batch, decision.k) == (512, 64, 4.0)
    assert model.trials == [128, 256, 512]


def test_first_success_stops_the_search():
    model = TableModel({128: 4, 256: 9, 512: 16})
    assert total_batch_size(2, 128, 8, model).global_batch == 256
    assert model.trials == [128, 256]


def test_all_trials_fail_weak_scales_by_the_worker_ratio():
    # k = 1, 2 are tried (k = 4 > 6/2); both fail: TBS × N'/N = 100 × 6/2
    model = TableModel({100: 2, 200: 3})
    decision = total_batch_size(2, 100, 6, model)
    assert model.trials == [100, 200]
    assert (decision.global_batch, decision.local_batch, decision.k) == (300, 50, 3.0)
    assert "all trials failed" in decision.reason


def test_weak_fallback_rounds_non_integer_ratios():
    decision = total_batch_size(3, 100, 4, TableModel({100: 3}))
    assert decision.global_batch == 133  # 100 × 4/3, rounded


def test_max_global_batch_stops_the_trials_and_caps_the_fallback():
    model = TableModel({128: 4, 256: 6, 512: 8})
    decision = total_batch_size(2, 128, 8, model, ScalingLimits(max_global_batch=300))
    assert model.trials == [128, 256]  # 512 would exceed the cap: never tried
    assert (decision.global_batch, decision.local_batch) == (300, 38)
    assert "capped" in decision.reason


def test_min_local_batch_skips_too_small_trials():
    # 64 over 16 workers is 4 per worker < 8: skipped without asking the model
    model = TableModel({128: 16})
    decision = total_batch_size(2, 64, 16, model, ScalingLimits(min_local_batch=8))
    assert model.trials == [128]
    assert (decision.global_batch, decision.local_batch, decision.k) == (128, 8, 2.0)


def test_max_local_batch_caps_a_scale_out_result():
    decision = total_batch_size(2, 512, 4, TableModel({512: 1, 1024: 1}), ScalingLimits(max_local_batch=200))
    assert (decision.global_batch, decision.local_batch) == (800, 200)  # weak 1024 > 4 × 200


def test_unchanged_world_keeps_the_batch():
    decision = total_batch_size(4, 96, 4, TableModel({}))
    assert (decision.global_batch, decision.k) == (96, 1.0)


def test_candidates_default_beyond_the_new_world():
    seen = []

    class Spy(TableModel):
        def optimal_workers(self, global_batch, candidates):
            seen.append(list(candidates))
            return 8

    total_batch_size(2, 64, 4, Spy({}))
    assert seen == [list(range(1, 9))]


# ---------------------------------------------------------------------- scale-in mirror


def test_scale_in_keeps_the_batch_without_a_memory_cap():
    decision = total_batch_size(8, 256, 2, TableModel({}))
    assert (decision.global_batch, decision.local_batch, decision.k) == (256, 128, 1.0)


def test_scale_in_halves_only_as_far_as_max_local_batch_needs():
    decision = total_batch_size(8, 256, 2, TableModel({}), ScalingLimits(max_local_batch=64))
    assert (decision.global_batch, decision.local_batch, decision.k) == (128, 64, 0.5)


def test_scale_in_all_halvings_fail_weak_scales_then_caps():
    # 4 → 2: k = 1 (128/worker) and k = 1/2 (64/worker) exceed 32; k = 1/4 < 2/4 is not tried;
    # weak scaling gives 128 (64/worker), still over the cap: 2 × 32
    decision = total_batch_size(4, 256, 2, TableModel({}), ScalingLimits(max_local_batch=32))
    assert (decision.global_batch, decision.local_batch, decision.k) == (64, 32, 0.25)
    assert "weak scaling" in decision.reason and "capped" in decision.reason


# ---------------------------------------------------------------------- policies


def test_strong_policy_keeps_the_global_batch():
    decision = scale_global_batch("strong", 2, 4, 128, TableModel({128: 1}))
    assert (decision.global_batch, decision.k) == (128, 1.0)


def test_strong_policy_still_honours_the_memory_cap_on_scale_in():
    decision = scale_global_batch("strong", 4, 1, 128, limits=ScalingLimits(max_local_batch=64))
    assert decision.global_batch == 64


def test_weak_policy_scales_with_the_workers():
    assert scale_global_batch("weak", 2, 4, 64).global_batch == 128
    assert scale_global_batch("weak", 4, 2, 64).global_batch == 32
    assert scale_global_batch("weak", 2, 4, 64, limits=ScalingLimits(max_global_batch=100)).global_batch == 100


def test_hybrid_is_strong_until_the_model_is_ready():
    not_ready = TableModel({128: 1}, ready=False)
    decision = scale_global_batch("hybrid", 2, 8, 128, not_ready)
    assert decision.global_batch == 128 and not_ready.trials == []
    assert "not ready" in decision.reason
    assert scale_global_batch("hybrid", 2, 8, 128, TableModel({128: 1, 256: 1, 512: 8})).global_batch == 512


@pytest.mark.parametrize(
    "make",
    [
        lambda: ScalingLimits(min_local_batch=0),
        lambda: ScalingLimits(min_local_batch=8, max_local_batch=4),
        lambda: ScalingLimits(max_global_batch=0),
        lambda: scale_global_batch("elastic", 2, 4, 64),
        lambda: total_batch_size(0, 64, 4, TableModel({})),
        lambda: total_batch_size(2, 0, 4, TableModel({})),
    ],
)
def test_invalid_arguments_raise(make):
    with pytest.raises(ValueError):
        make()


def test_decision_round_trips_through_json():
    decision = ScalingDecision(256, 32, 2.0, "because", lr_scale=2.0)
    assert ScalingDecision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision


# ---------------------------------------------------------------------- throughput model


def true_compute(b: int) -> float:
    return 0.010 + 0.0005 * max(b, 32)  # flat below 32 samples (a device not yet saturated)


def true_allreduce(n: int) -> float:
    return 0.0 if n == 1 else 0.004 + 0.03 * (n - 1) / n


def true_t_iter(g: int, n: int) -> float:
    return true_compute(math.ceil(g / n)) + true_allreduce(n)


def true_optimum(g: int, candidates: range) -> int:
    return max(candidates, key=lambda n: (g / true_t_iter(g, n), -n))


def fitted_model(noise: float = 0.0, seed: int = 0) -> ThroughputModel:
    rng = random.Random(seed)
    model = ThroughputModel(min_observations=3)
    for _ in range(5):
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for n in (2, 4, 8):
                jitter = 1 + rng.uniform(-noise, noise)
                model.observe_step(b, n, true_compute(b) * jitter, true_allreduce(n) * jitter)
    return model


def test_model_predicts_unobserved_world_sizes_of_the_synthetic_curve():
    model = fitted_model()
    for n in (3, 5, 6, 12, 16):
        assert model.t_allreduce(n) == pytest.approx(true_allreduce(n), rel=1e-9)
    for g, n in [(100, 3), (512, 12), (1000, 7)]:
        assert model.t_iter(g, n) == pytest.approx(true_t_iter(g, n), rel=1e-9)


@pytest.mark.parametrize("global_batch", [64, 128, 256, 512, 1000])
def test_model_recovers_the_synthetic_optimum(global_batch):
    candidates = range(1, 33)
    expected = true_optimum(global_batch, candidates)
    assert fitted_model().optimal_workers(global_batch, candidates) == expected
    if global_batch in (128, 256, 512):
        assert expected == global_batch // 32  # the knee of the curve: an interior optimum


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_model_lands_near_the_optimum(seed):
    model = fitted_model(noise=0.05, seed=seed)
    candidates = range(1, 33)
    for g in (128, 256, 512):
        chosen = model.optimal_workers(g, candidates)
        best = true_optimum(g, candidates)
        assert g / true_t_iter(g, chosen) >= 0.97 * g / true_t_iter(g, best)


def test_algorithm1_on_the_fitted_model():
    # N_opt(128) = 4 < 8, N_opt(256) = 8: growing 4 → 8 doubles the batch; 4 → 16 quadruples it
    model = fitted_model()
    assert total_batch_size(4, 128, 8, model).global_batch == 256
    assert total_batch_size(4, 128, 16, model).global_batch == 512
    assert total_batch_size(4, 128, 2, model).global_batch == 128


def test_readiness_needs_two_batch_sizes_and_one_multi_worker_world():
    model = ThroughputModel(min_observations=2)
    for _ in range(2):
        model.observe_step(32, 1, 0.1, 0.0)
    model.observe_step(16, 2, 0.05, 0.01)
    assert not model.ready()
    model.observe_step(16, 2, 0.05, 0.01)
    assert model.ready()


def test_compute_curve_is_monotone_and_extrapolates_with_the_fitted_slope():
    model = ThroughputModel()
    model.observe_step(16, 1, 0.30, 0.0)  # noise: slower than 32
    model.observe_step(32, 1, 0.20, 0.0)
    model.observe_step(64, 1, 0.40, 0.0)
    values = [model.t_compute(b) for b in (8, 16, 24, 32, 48, 64, 128)]
    assert values == sorted(values)
    assert model.t_compute(16) == model.t_compute(32) == pytest.approx(0.25)  # pooled violators
    assert model.t_compute(128) > model.t_compute(64)


def test_single_points_extrapolate_proportionally():
    model = ThroughputModel()
    model.observe_step(10, 4, 1.0, 0.3)
    assert model.t_compute(20) == pytest.approx(2.0)
    assert model.t_allreduce(1) == 0.0
    assert model.t_allreduce(2) == pytest.approx(0.3 * (1 / 2) / (3 / 4))  # α = 0: bandwidth term only
    assert model.t_allreduce(4, nbytes=None) == pytest.approx(0.3)


def test_allreduce_scales_with_message_size():
    model = ThroughputModel(grad_bytes=1000)
    model.observe_step(8, 2, 0.1, 0.02)
    model.observe_step(8, 4, 0.1, 0.03)
    assert model.t_allreduce(4, nbytes=2000) > model.t_allreduce(4)


def test_running_means_follow_recent_steps():
    model = ThroughputModel(window=4)
    for _ in range(50):
        model.observe_step(8, 1, 1.0, 0.0)
    for _ in range(20):
        model.observe_step(8, 1, 2.0, 0.0)
    assert model.t_compute(8) == pytest.approx(2.0, abs=0.01)


def test_model_without_data_refuses_to_predict():
    with pytest.raises(ValueError):
        ThroughputModel().t_iter(64, 2)


def test_model_state_round_trips_through_json():
    model = fitted_model(noise=0.05)
    copy = ThroughputModel.from_state_dict(json.loads(json.dumps(model.state_dict())))
    assert copy.ready()
    for g, n in [(64, 3), (256, 8), (700, 20)]:
        assert copy.t_iter(g, n) == model.t_iter(g, n)


# ---------------------------------------------------------------------- summary for `elan status`


def test_summary_is_json_and_lists_current_and_next_batches():
    model = fitted_model()
    decision = ScalingDecision(256, 32, 2.0, "hybrid: N_opt(256)=8 >= 8: global batch x2", 2.0)
    summary = json.loads(json.dumps(scaling_summary(model, "hybrid", 128, 4, decision)))
    assert [table["global_batch"] for table in summary["throughput"]] == [128, 256]
    assert [table["optimal_workers"] for table in summary["throughput"]] == [4, 8]
    assert list(summary["throughput"][0]["samples_per_s"]) == ["1", "2", "4", "8", "16"]
    assert summary["last_decision"]["reason"].startswith("hybrid")
    lines = format_summary(summary)
    assert "ready" in lines[0] and "best 4" in lines[1] and "global batch 256 (local 32, k=2)" in lines[-1]


def test_summary_of_an_empty_model_predicts_nothing():
    summary = scaling_summary(ThroughputModel(), "strong", 64, 2, None)
    assert summary["model_ready"] is False
    assert summary["throughput"][0] == {"global_batch": 64, "samples_per_s": {}, "optimal_workers": None}


# ---------------------------------------------------------------------- step timer


def test_timer_single_worker_step_is_all_compute_and_teaches_the_backward_ratio():
    timer = StepTimer(backward_ratio=2.0)
    timer.batch_start(0.0, 16, 1)
    timer.before_backward(1.0)
    timer.after_backward(2.5)
    timer.optimizer_step()
    sample = timer.batch_end(3.0)
    assert (sample.local_batch, sample.world_size, sample.compute_s, sample.allreduce_s) == (16, 1, 3.0, 0.0)
    assert timer.backward_ratio == pytest.approx(1.5)


def test_timer_attributes_excess_backward_time_to_the_allreduce():
    timer = StepTimer(backward_ratio=1.5)
    timer.batch_start(10.0, 8, 4)
    timer.before_backward(11.0)
    timer.after_backward(13.5)  # 2.5 s backward: 1.5 s compute estimate, 1.0 s all-reduce
    timer.optimizer_step()
    sample = timer.batch_end(14.0)
    assert (sample.compute_s, sample.allreduce_s) == pytest.approx((3.0, 1.0))
    assert timer.backward_ratio == 1.5  # a synchronised step teaches nothing about the ratio


def test_timer_prefers_a_measured_allreduce():
    timer = StepTimer()
    timer.batch_start(0.0, 8, 2)
    timer.before_backward(1.0)
    timer.after_backward(4.0)
    timer.allreduce(0.4)
    timer.optimizer_step()
    assert timer.batch_end(5.0).allreduce_s == pytest.approx(0.4)


def test_timer_skips_accumulation_micro_batches_and_incomplete_batches():
    timer = StepTimer(backward_ratio=2.0)
    timer.batch_start(0.0, 8, 2)
    timer.before_backward(1.0)
    timer.after_backward(2.0)
    assert timer.batch_end(2.5) is None  # no optimizer step: DDP did not all-reduce
    assert timer.backward_ratio == pytest.approx(1.0)
    timer.batch_start(3.0, 8, 2)
    assert timer.batch_end(4.0) is None  # no backward seen

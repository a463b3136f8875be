"""HybridScaling with a stand-in trainer: decisions and LR targets, applying them, timing hooks, state, summary."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_elan.callbacks import HybridScaling, ProgressiveLinearLR, ScalingDecision
from lightning_elan.callbacks import hybrid as hybrid_module
from lightning_elan.scaling import ThroughputModel


class FakeModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)  # 10 float32 parameters: 40 bytes of gradients
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged[name] = value


def make_trainer(world_size=2, global_batch=64, step=0, callbacks=()):
    strategy = SimpleNamespace(data_position=SimpleNamespace(global_batch=global_batch))
    return SimpleNamespace(world_size=world_size, global_step=step, strategy=strategy, callbacks=list(callbacks))


def ready_profile(path) -> str:
    """N_opt = G/32 (see test_scaling): 4 → 8 workers at G = 128 needs G = 256."""
    model = ThroughputModel()
    for _ in range(3):
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for n in (2, 4, 8):
                model.observe_step(b, n, 0.010 + 0.0005 * max(b, 32), 0.004 + 0.03 * (n - 1) / n)
    path.write_text(json.dumps(model.state_dict()))
    return str(path)


def test_policies_decide_and_the_lr_target_is_relative_to_the_first_batch(tmp_path):
    assert HybridScaling("strong").decide(2, 4, 64).global_batch == 64
    weak = HybridScaling("weak")
    first = weak.decide(2, 4, 64)
    assert (first.global_batch, first.k, first.lr_scale) == (128, 2.0, 2.0)
    second = weak.decide(4, 8, 128)
    assert (second.global_batch, second.k, second.lr_scale) == (256, 2.0, 4.0)  # ×4 since the start
    assert weak.last_decision == second
    assert HybridScaling("weak", lr_rule="sqrt").decide(2, 8, 64).lr_scale == pytest.approx(2.0)


def test_hybrid_uses_the_profile_once_ready_and_strong_before(tmp_path):
    assert HybridScaling("hybrid").decide(4, 8, 128).global_batch == 128  # nothing learned yet
    profiled = HybridScaling("hybrid", profile=ready_profile(tmp_path / "p.json"), learn=False)
    decision = profiled.decide(4, 8, 128)
    assert (decision.global_batch, decision.lr_scale) == (256, 2.0)
    capped = HybridScaling("hybrid", profile=ready_profile(tmp_path / "q.json"), max_global_batch=200)
    assert capped.decide(4, 8, 128).global_batch == 200


def test_apply_starts_the_ramp_on_every_progressive_lr_callback():
    ramp = ProgressiveLinearLR(ramp_steps=10)
    scaling = HybridScaling("weak")
    trainer = make_trainer(step=42, callbacks=[scaling, ramp])
    payload = json.loads(json.dumps(scaling.decide(2, 4, 64).to_dict()))  # as broadcast
    other_rank = HybridScaling("weak")
    other_rank.apply(trainer, payload)
    assert (ramp.ramp.start_step, ramp.ramp.from_scale, ramp.ramp.to_scale) == (42, 1.0, 2.0)
    assert other_rank.global_batch == 128 and other_rank.base_global_batch == 64
    assert other_rank.last_decision == ScalingDecision.from_dict(payload)


def test_hooks_time_every_step_and_feed_the_model(monkeypatch):
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(hybrid_module.time, "perf_counter", lambda: next(clock))
    scaling, module = HybridScaling("hybrid", warmup_steps=1), FakeModule()
    trainer = make_trainer(world_size=2, global_batch=64)
    scaling.setup(trainer, module, "fit")
    assert scaling.model.grad_bytes == 40
    for _ in range(3):
        batch = (torch.zeros(32, 4), torch.zeros(32))
        scaling.on_train_batch_start(trainer, module, batch, 0)  # t
        scaling.on_before_backward(trainer, module, torch.tensor(0.0))  # t+1: forward 1 s
        scaling.on_after_backward(trainer, module)  # t+2: backward 1 s < 2 × forward: no all-reduce visible
        scaling.on_before_optimizer_step(trainer, module, None)
        scaling.on_train_batch_end(trainer, module, None, batch, 0)  # t+3
    counts = scaling.model.observation_counts()
    assert counts == {"compute": {"32": 2}, "allreduce": {"2": 2}}  # first step skipped (warm-up)
    assert scaling.model.t_compute(32) == pytest.approx(3.0)
    assert module.logged == {"elan/local_batch": 32.0, "elan/world_size": 2.0, "elan/global_batch": 64.0}


def test_state_and_summary_are_json_and_restore_a_replica(tmp_path):
    scaling = HybridScaling("hybrid", profile=ready_profile(tmp_path / "p.json"))
    scaling.global_batch, scaling.world_size = 128, 4
    scaling.decide(4, 8, 128)
    state = json.loads(json.dumps(scaling.state_dict()))
    joiner = HybridScaling("hybrid")
    joiner.load_state_dict(state)
    joiner.world_size = 8
    assert joiner.model.ready() and joiner.last_decision == scaling.last_decision
    decision = joiner.decide(8, 16, 256)
    assert (decision.global_batch, decision.lr_scale) == (512, 4.0)  # N_opt(256) = 8 < 16, N_opt(512) = 16
    joiner.apply(make_trainer(world_size=16), decision)
    joiner.world_size = 16  # as the next step's on_train_batch_start sees it
    summary = json.loads(json.dumps(joiner.summary()))
    assert summary["policy"] == "hybrid" and summary["last_decision"]["global_batch"] == 512
    assert [table["global_batch"] for table in summary["throughput"]] == [512, 1024]
    assert [table["optimal_workers"] for table in summary["throughput"]] == [16, 32]


@pytest.mark.parametrize("kwargs", [{"policy": "elastic"}, {"lr_rule": "cubic"}, {"min_local_batch": 0}])
def test_invalid_configuration_raises(kwargs):
    with pytest.raises(ValueError):
        HybridScaling(**kwargs)


def test_callbacks_configure_from_a_lightning_cli_style_config():
    jsonargparse = pytest.importorskip("jsonargparse")
    from lightning.pytorch.callbacks import Callback

    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    config = parser.parse_args(["--callbacks", json.dumps([
        {"class_path": "lightning_elan.callbacks.HybridScaling",
         "init_args": {"policy": "hybrid", "max_global_batch": 4096, "lr_rule": "sqrt"}},
        {"class_path": "lightning_elan.callbacks.ProgressiveLinearLR", "init_args": {"ramp_steps": 50}},
    ])])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    scaling, ramp = instantiate(config).callbacks
    assert (scaling.policy, scaling.limits.max_global_batch, scaling.lr_rule) == ("hybrid", 4096, "sqrt")
    assert isinstance(ramp, ProgressiveLinearLR) and ramp.ramp_steps == 50

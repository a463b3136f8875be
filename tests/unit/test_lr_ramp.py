"""The progressive linear LR rule (Elan eq. 2–3) and ProgressiveLinearLR's multiplier inside the optimizer step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_elan.callbacks import ProgressiveLinearLR
from lightning_elan.scaling import LRRamp, lr_factor, lr_scale, next_ramp

RAMP = LRRamp(start_step=10, ramp_steps=100, from_scale=1.0, to_scale=2.0)


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 1.0), (10, 1.0), (60, 1.5), (35, 1.25), (109, 1.99), (110, 2.0), (500, 2.0)],
)
def test_ramp_before_at_t0_halfway_at_end_and_after(step, expected):
    assert lr_scale(step, RAMP) == pytest.approx(expected)


def test_no_ramp_is_scale_one_and_zero_length_ramp_jumps():
    assert lr_scale(123, None) == 1.0
    jump = LRRamp(5, 0, 1.0, 4.0)
    assert (lr_scale(4, jump), lr_scale(5, jump)) == (1.0, 4.0)


def test_ramp_down_after_a_shrink():
    down = LRRamp(0, 10, 2.0, 1.0)
    assert lr_scale(5, down) == pytest.approx(1.5)


def test_successive_ramps_start_from_the_current_scale():
    second = next_ramp(RAMP, 60, 4.0, 100)  # mid-way through the first ramp (x1.5)
    assert (second.start_step, second.from_scale, second.to_scale) == (60, 1.5, 4.0)
    assert lr_scale(60, second) == pytest.approx(1.5)
    assert lr_scale(110, second) == pytest.approx(2.75)
    assert lr_scale(160, second) == 4.0
    third = next_ramp(second, 400, 8.0, 100)
    assert (third.from_scale, lr_scale(450, third)) == (4.0, pytest.approx(6.0))


def test_lr_rules():
    assert lr_factor(4.0, "linear") == 4.0
    assert lr_factor(4.0, "sqrt") == 2.0
    assert lr_factor(0.5, "linear") == 0.5
    with pytest.raises(ValueError):
        lr_factor(2.0, "cubic")
    with pytest.raises(ValueError):
        LRRamp(0, -1, 1.0, 2.0)


def test_ramp_round_trips_through_json():
    assert LRRamp.from_dict(json.loads(json.dumps(RAMP.to_dict()))) == RAMP


# ---------------------------------------------------------------------- the callback, with a real optimizer


class FakeModule:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged[name] = value


def make_trainer(lrs=(0.1, 0.01), step: int = 0):
    params = [torch.nn.Parameter(torch.ones(2)) for _ in lrs]
    optimizer = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs, strict=True)])
    for p in params:
        p.grad = torch.ones(2)
    trainer = SimpleNamespace(global_step=step, optimizers=[optimizer], precision_plugin=SimpleNamespace())
    return trainer, optimizer, params


def test_lr_is_scaled_during_the_step_and_restored_after():
    callback, module = ProgressiveLinearLR(ramp_steps=10), FakeModule()
    trainer, optimizer, params = make_trainer(step=5)
    callback.on_fit_start(trainer, module)
    callback.start_ramp(0, 3.0)  # x2 at step 5
    callback.on_before_optimizer_step(trainer, module, optimizer)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.2, 0.02])
    callback.on_before_optimizer_step(trainer, module, optimizer)  # closure evaluated again (LBFGS): no double scale
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    optimizer.step()
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.01]  # restored exactly
    assert params[0].detach().tolist() == pytest.approx([0.8, 0.8])  # the update used 2 × 0.1
    assert module.logged["elan/lr_scale"] == pytest.approx(2.0)


def test_scale_one_leaves_the_optimizer_untouched():
    callback, module = ProgressiveLinearLR(), FakeModule()
    trainer, optimizer, _ = make_trainer()
    lr_object = optimizer.param_groups[0]["lr"]
    callback.on_before_optimizer_step(trainer, module, optimizer)
    assert optimizer.param_groups[0]["lr"] is lr_object
    assert module.logged["elan/lr_scale"] == 1.0


def test_a_step_that_never_ran_is_restored_at_batch_end():
    callback, module = ProgressiveLinearLR(ramp_steps=0), FakeModule()
    trainer, optimizer, _ = make_trainer()
    callback.start_ramp(0, 2.0)
    callback.on_before_optimizer_step(trainer, module, optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    callback.on_train_batch_end(trainer, module)
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_an_lr_set_during_the_step_is_kept():
    callback, module = ProgressiveLinearLR(ramp_steps=0), FakeModule()
    trainer, optimizer, _ = make_trainer()
    callback.start_ramp(0, 2.0)
    callback.on_before_optimizer_step(trainer, module, optimizer)
    optimizer.param_groups[0]["lr"] = 0.05
    callback.on_train_batch_end(trainer, module)
    assert [group["lr"] for group in optimizer.param_groups] == [0.05, 0.01]


def test_teardown_removes_the_post_hook():
    callback, module = ProgressiveLinearLR(), FakeModule()
    trainer, optimizer, _ = make_trainer()
    callback.on_fit_start(trainer, module)
    assert len(optimizer._optimizer_step_post_hooks) == 1
    callback.teardown(trainer, module, "fit")
    assert len(optimizer._optimizer_step_post_hooks) == 0


def test_state_carries_the_ramp_and_a_same_target_does_not_restart_it():
    callback = ProgressiveLinearLR(ramp_steps=100)
    callback.start_ramp(10, 2.0)
    callback.start_ramp(60, 2.0)  # e.g. a strong-scaling adjustment mid-ramp
    assert callback.ramp == RAMP
    restored = ProgressiveLinearLR(ramp_steps=100)
    restored.load_state_dict(json.loads(json.dumps(callback.state_dict())))
    assert restored.ramp == RAMP and restored.scale_at(60) == pytest.approx(1.5)
    restored.start_ramp(60, 4.0)
    assert (restored.ramp.from_scale, restored.target_scale) == (pytest.approx(1.5), 4.0)
    empty = ProgressiveLinearLR()
    empty.load_state_dict({"ramp": None})
    assert empty.ramp is None and empty.target_scale == 1.0


def test_negative_ramp_steps_rejected():
    with pytest.raises(ValueError):
        ProgressiveLinearLR(ramp_steps=-1)

"""The pure parts of the Accelerate integration: options, refusals, the scaling participant and its LR ramp, what the
prepared loaders read of the user's loader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_elan.accelerate.data import (
    ElasticEvaluationLoader,
    ElasticTrainLoader,
    EvaluationLoader,
    refuse_unsupported,
)
from lightning_elan.accelerate.plugin import ElasticPlugin
from lightning_elan.accelerate.scaling import AccelerateScaling


@pytest.mark.parametrize(("field", "value", "message"), [
    ("scaling", "elastic", "scaling must be one of"),
    ("lr_rule", "cubic", "lr_rule must be one of"),
    ("lr_ramp_steps", -1, "lr_ramp_steps must be >= 0"),
    ("global_batch_size", 0, "global_batch_size must be >= 1"),
    ("coordinate_every", 0, "coordinate_every must be >= 1"),
    ("hsdp_group_size", 0, "hsdp_group_size must be a positive integer"),
    ("hsdp_group_size", True, "hsdp_group_size must be a positive integer"),
])
def test_plugin_rejects_bad_options_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        ElasticPlugin(**{field: value})


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_unsupported_training_loaders_are_refused_with_the_reason():
    with pytest.raises(NotImplementedError, match="dispatch_batches"):
        refuse_unsupported(DataLoader(TensorDataset(torch.zeros(4)), batch_size=2), dispatch_batches=True)
    with pytest.raises(NotImplementedError, match="IterableDataset"):
        refuse_unsupported(DataLoader(_Stream(), batch_size=2), dispatch_batches=None)
    batches = DataLoader(TensorDataset(torch.zeros(4)), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="batch_size"):
        refuse_unsupported(batches, dispatch_batches=None)


def test_weak_scaling_decision_starts_an_lr_ramp_at_the_next_step():
    step = {"next": 7}
    scaling = AccelerateScaling(ElasticPlugin(scaling="weak", lr_ramp_steps=4), lambda: step["next"])
    decision = scaling.decide_resize(2, 4, 12)
    assert (decision.global_batch, decision.lr_scale) == (24, 2.0)
    scaling.apply_resize(decision)
    assert [scaling.lr_scale_at(s) for s in (6, 7, 8, 9, 11, 20)] == [1.0, 1.0, 1.25, 1.5, 2.0, 2.0]
    joiner = AccelerateScaling(ElasticPlugin(scaling="weak", lr_ramp_steps=4), lambda: 0)
    joiner.load_state_dict(scaling.state_dict())  # what a joiner receives
    assert joiner.lr_scale_at(9) == 1.5 and joiner.last_decision == decision
    scaling.apply_resize(decision)  # the same target again: the ramp in progress is kept
    assert scaling.ramp == joiner.ramp


def test_strong_scaling_keeps_the_batch_and_the_lr():
    scaling = AccelerateScaling(ElasticPlugin(), lambda: 3)
    decision = scaling.decide_resize(2, 3, 12)
    scaling.apply_resize(decision)
    assert decision.global_batch == 12 and scaling.lr_scale_at(100) == 1.0


@pytest.mark.parametrize("plugin", ["deepspeed_plugin", "parallelism_config"])
def test_sharded_training_is_refused_before_anything_starts(plugin):
    from lightning_elan.accelerate import ElasticAccelerator

    with pytest.raises(NotImplementedError, match="data-parallel training"):
        ElasticAccelerator(**{plugin: object()})


@pytest.mark.parametrize(("options", "refusal"), [
    ({"fsdp_version": 1}, "FSDP2 only: pass FullyShardedDataParallelPlugin\\(fsdp_version=2"),
    ({"fsdp_version": 2, "cpu_ram_efficient_loading": True}, "cpu_ram_efficient_loading is not supported"),
    ({"fsdp_version": 2, "cpu_offload": True}, "cpu_offload is not supported"),
])
def test_fsdp1_and_the_fsdp2_options_a_resize_cannot_keep_are_refused(options, refusal, monkeypatch):
    """FSDP2 is elastic (tests/integration/test_accelerate_fsdp.py); FSDP1 and these options are refused, saying why,
    before anything starts."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    for variable in ("FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_SYNC_MODULE_STATES"):  # the plugin writes them
        monkeypatch.setenv(variable, "false")

    from lightning_elan.accelerate import ElasticAccelerator

    with pytest.raises(NotImplementedError, match=refusal):
        ElasticAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**options))


class _World:
    """An evaluation host of a fixed world (rank 0 of 2)."""

    def evaluation_world(self) -> tuple[int, int]:
        return 0, 2


def test_prepared_loaders_read_the_users_loader():
    """Each reads ``dataset``, ``batch_size`` and ``sampler`` of the user's loader; an evaluation loader forwards any
    other public attribute (``EvaluationLoader``: of the loader Accelerate sharded, its sampler too), a training loader
    none."""
    user = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3, num_workers=0)
    sharded = DataLoader(TensorDataset(torch.arange(5.0)), batch_size=3, shuffle=True)
    elastic = ElasticEvaluationLoader(user, _World(), None, False)
    accelerate = EvaluationLoader(user, lambda loader: sharded, _World(), "a reason")
    train = ElasticTrainLoader(user, None, None, False)  # the user's loader stands in for the ElasticDataLoader
    for loader in (elastic, accelerate, train):
        assert loader.dataset is user.dataset and loader.batch_size == 3
    assert elastic.sampler is user.sampler and train.sampler is user.sampler and accelerate.sampler is sharded.sampler
    assert elastic.num_workers == 0 and accelerate.batch_sampler is sharded.batch_sampler
    assert len(elastic) == 2 and len(accelerate) == 2
    with pytest.raises(AttributeError):
        train.num_workers  # noqa: B018
    with pytest.raises(AttributeError):
        elastic._private  # noqa: B018


def test_only_an_fsdp2_job_reshards_live():
    """The engine reshards live with a front-end that is ``LiveResharding``: the accelerator itself is not (a
    data-parallel job's joiners would wait in a reshard of shards nobody holds), only the front-end of an FSDP2 job."""
    from lightning_elan.accelerate.accelerator import ElasticAccelerator, _ShardedFrontEnd
    from lightning_elan.elastic.live_reshard import LiveResharding

    assert not issubclass(ElasticAccelerator, LiveResharding)
    assert isinstance(_ShardedFrontEnd(object()), LiveResharding)  # type: ignore[arg-type]

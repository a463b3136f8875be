"""Lightning ``FSDPStrategy``'s options passed to ``ElanFSDPStrategy`` (``lightning_elan.fsdp_options``): read into
their FSDP2 meaning, or refused with what to pass instead — never silently dropped."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

from lightning_elan.fsdp_options import FSDPStrategyOptions, read_fsdp_strategy_options


def test_fsdp_strategys_options_are_read_as_fsdp2_does_them() -> None:
    options = {"auto_wrap_policy": {nn.TransformerEncoderLayer}, "activation_checkpointing_policy": [nn.Linear],
               "sharding_strategy": "SHARD_GRAD_OP"}
    assert read_fsdp_strategy_options(options) == FSDPStrategyOptions(
        frozenset({nn.TransformerEncoderLayer}), frozenset({nn.Linear}), reshard_after_forward=False)
    assert options == {}
    assert read_fsdp_strategy_options({"sharding_strategy": ShardingStrategy.FULL_SHARD}).reshard_after_forward is True
    assert read_fsdp_strategy_options({"auto_wrap_policy": nn.Linear}).shard_modules == {nn.Linear}
    assert read_fsdp_strategy_options({}) == FSDPStrategyOptions()


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"sharding_strategy": "HYBRID_SHARD"}, NotImplementedError, "pass hsdp_group_size=k"),
    ({"sharding_strategy": ShardingStrategy.NO_SHARD}, NotImplementedError, "use strategy='elan'"),
    ({"sharding_strategy": "FULL"}, ValueError, "expected one of"),
    ({"auto_wrap_policy": lambda module, recurse, size: True}, NotImplementedError, "a set of module classes"),
    ({"mixed_precision": object()}, NotImplementedError, "MixedPrecisionPolicy"),
    ({"cpu_offload": True}, NotImplementedError, "not supported"),
    ({"find_unused_parameters": True}, NotImplementedError, "a DDP option"),
    ({"limit_all_gathers": True, "forward_prefetch": True}, TypeError, "'limit_all_gathers', 'forward_prefetch'"),
])
def test_an_option_without_an_fsdp2_meaning_is_refused_saying_what_to_do(options, error, message) -> None:
    with pytest.raises(error, match=message):
        read_fsdp_strategy_options(dict(options))


def test_the_strategy_takes_them_and_refuses_the_rest() -> None:
    from lightning_elan.strategy.fsdp import ElanFSDPStrategy

    strategy = ElanFSDPStrategy(auto_wrap_policy={nn.Linear}, activation_checkpointing_policy={nn.Linear},
                                sharding_strategy="SHARD_GRAD_OP")
    assert (strategy.shard_modules, strategy.checkpointed_modules) == ({nn.Linear}, {nn.Linear})
    assert strategy.reshard_after_forward is False
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) 'use_orig_params'"):
        ElanFSDPStrategy(use_orig_params=True)
    with pytest.raises(ValueError, match="not both"):
        ElanFSDPStrategy(shard_modules={nn.Linear}, auto_wrap_policy={nn.Linear})

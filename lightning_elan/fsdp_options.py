"""Lightning ``FSDPStrategy``'s options, as a user moving to ``ElanFSDPStrategy`` passes them (pure: no Lightning).

``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, sharding_strategy="SHARD_GRAD_OP")``
becomes ``ElanFSDPStrategy(...)`` with the same arguments: each is read into what FSDP2 does alike (the classes'
instances each a ``fully_shard`` unit, wrapped by ``checkpoint_wrapper``, ``reshard_after_forward=False``). An option
that has no FSDP2 meaning here is refused with what to pass instead — never dropped: an ``ElanFSDPStrategy`` passes no
option to DDP, so one it did not read would be silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["FSDPStrategyOptions", "read_fsdp_strategy_options"]

_SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
"""FSDP1's sharding strategies FSDP2 has, as ``reshard_after_forward``."""
_REFUSED = {
    "mixed_precision": "pass mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) "
                       "(FSDP2's policy), or Trainer(precision=...)",
    "cpu_offload": "CPU offload is not supported by strategy='elan_fsdp'; leave it unset",
    "device_mesh": "the mesh is the job's (one per generation); pass hsdp_group_size=k for HSDP",
    "process_group": "the process group is the job's; leave it unset",
    "static_graph": "a DDP option; leave it unset",
    "find_unused_parameters": "a DDP option; FSDP2 needs none; leave it unset",
}


@dataclass(frozen=True)
class FSDPStrategyOptions:
    """What ``ElanFSDPStrategy`` takes from Lightning ``FSDPStrategy``'s options."""

    shard_modules: frozenset[type] = frozenset()
    checkpointed_modules: frozenset[type] = frozenset()
    reshard_after_forward: bool | None = None  # None: not given


def read_fsdp_strategy_options(options: dict[str, Any]) -> FSDPStrategyOptions:
    """Read and remove ``auto_wrap_policy``, ``activation_checkpointing_policy`` and ``sharding_strategy`` from
    ``options`` (an ``ElanFSDPStrategy``'s extra keyword arguments); any other left is refused (``TypeError`` naming
    it, or ``ValueError``/``NotImplementedError`` saying what to pass instead)."""
    shard = _module_classes(options.pop("auto_wrap_policy", None), "auto_wrap_policy")
    checkpointed = _module_classes(options.pop("activation_checkpointing_policy", None),
                                   "activation_checkpointing_policy")
    reshard = _reshard_after_forward(options.pop("sharding_strategy", None))
    for name in options:
        if name in _REFUSED:
            raise NotImplementedError(f"ElanFSDPStrategy({name}=...): {_REFUSED[name]}")
    if options:
        raise TypeError(f"ElanFSDPStrategy got unexpected keyword argument(s) {', '.join(map(repr, options))}: it "
                        "takes shard_modules, reshard_after_forward, mp_policy, hsdp_group_size, reshard_chunk_mb, "
                        "state_dict_type, Lightning FSDPStrategy's auto_wrap_policy, activation_checkpointing_policy "
                        "and sharding_strategy, and ElanStrategy's options")
    return FSDPStrategyOptions(shard, checkpointed, reshard)


def _module_classes(policy: Any, name: str) -> frozenset[type]:
    """A set (list, tuple) of module classes, as Lightning's ``FSDPStrategy`` takes them; a policy function is
    refused (FSDP2 units are module instances, chosen by class here)."""
    if policy is None:
        return frozenset()
    if isinstance(policy, type):
        policy = {policy}
    if not isinstance(policy, Iterable) or isinstance(policy, (str, bytes)) or not all(
            isinstance(cls, type) for cls in policy):
        raise NotImplementedError(f"ElanFSDPStrategy({name}={policy!r}): pass a set of module classes (as "
                                  f"FSDPStrategy({name}={{Block}}) takes them); a policy function is not supported")
    return frozenset(policy)


def _reshard_after_forward(strategy: Any) -> bool | None:
    if strategy is None:
        return None
    key = getattr(strategy, "name", strategy)  # torch's ShardingStrategy enum or its name
    if key in _SHARDING_STRATEGIES:
        return _SHARDING_STRATEGIES[key]
    if key in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        raise NotImplementedError(f"ElanFSDPStrategy(sharding_strategy={key!r}): pass hsdp_group_size=k (shard within "
                                  "groups of k workers, replicate across them; the groups are the job's)")
    if key == "NO_SHARD":
        raise NotImplementedError("ElanFSDPStrategy(sharding_strategy='NO_SHARD'): use strategy='elan' (DDP)")
    raise ValueError(f"ElanFSDPStrategy(sharding_strategy={strategy!r}): expected one of 'FULL_SHARD', "
                     "'SHARD_GRAD_OP', 'HYBRID_SHARD'")

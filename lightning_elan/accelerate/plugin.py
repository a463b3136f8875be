"""ElasticPlugin: the elastic options of an ``ElasticAccelerator``, in Accelerate's plugin style (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_elan.protocol.contract import DEFAULT_JOIN_TIMEOUT_S
from lightning_elan.scaling.batch import POLICIES
from lightning_elan.scaling.lr import LR_RULES

__all__ = ["ElasticPlugin"]


@dataclass
class ElasticPlugin:
    """How an Accelerate job behaves when it changes size.

    Args:
        global_batch_size: samples per micro-step over all workers; default: the training DataLoader's ``batch_size``
            times the world size at launch. Kept under resizes unless ``scaling`` changes it.
        coordinate_every: optimizer steps between two questions to the application master (default: ``elan run``'s
            ``--coordinate-every``, else 10).
        join_timeout_s: how long a new worker waits inside ``prepare()`` to be admitted.
        replication: ``"auto"`` (nearest worker over CUDA IPC, shared memory or the network) or ``"collective"``;
            default ``$ELAN_REPLICATION``, else ``"auto"``.
        send_ahead: when a worker makes its shared-memory send segment before an adjustment: ``"joiners"``,
            ``"always"`` or ``"off"`` (``ElanStrategy``'s ``send_ahead``); default ``$ELAN_SEND_AHEAD``, else
            ``"joiners"``.
        scaling: ``"strong"`` (global batch kept), ``"weak"`` (× N'/N) or ``"hybrid"`` (Elan's Algorithm 1).
        lr_rule: ``"linear"`` or ``"sqrt"``: the LR multiplier for a global batch multiplied by k.
        lr_ramp_steps: optimizer steps over which the LR reaches its new multiplier after a resize (Elan eq. 2–3).
        min_local_batch, max_local_batch, max_global_batch: the limits of the hybrid policy.
        scaling_profile: a ``ThroughputModel`` JSON to start the hybrid policy from.
        hsdp_group_size: with an FSDP2 ``fsdp_plugin``: HSDP, sharding within groups of this many consecutive ranks
            and replicating across them whenever the world holds two or more such groups (else FSDP over all
            members); ``ElanFSDPStrategy``'s option of the same name.
    """

    global_batch_size: int | None = None
    coordinate_every: int | None = None
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    replication: str | None = None
    send_ahead: str | None = None
    scaling: str = "strong"
    lr_rule: str = "linear"
    lr_ramp_steps: int = 100
    min_local_batch: int = 1
    max_local_batch: int | None = None
    max_global_batch: int | None = None
    scaling_profile: str | None = None
    hsdp_group_size: int | None = None

    def __post_init__(self) -> None:
        if self.hsdp_group_size is not None and (type(self.hsdp_group_size) is not int or self.hsdp_group_size < 1):
            raise ValueError(f"ElasticPlugin.hsdp_group_size must be a positive integer, got {self.hsdp_group_size!r}")
        if self.scaling not in POLICIES:
            raise ValueError(f"ElasticPlugin.scaling must be one of {POLICIES}, got {self.scaling!r}")
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"ElasticPlugin.lr_rule must be one of {LR_RULES}, got {self.lr_rule!r}")
        if self.lr_ramp_steps < 0:
            raise ValueError(f"ElasticPlugin.lr_ramp_steps must be >= 0, got {self.lr_ramp_steps}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"ElasticPlugin.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.coordinate_every is not None and self.coordinate_every < 1:
            raise ValueError(f"ElasticPlugin.coordinate_every must be >= 1, got {self.coordinate_every}")

"""A member's mirror of its ward's FSDP2 shard, kept at the state after the last committed step (issue 24, Gemini).

Each member mirrors, in its host memory, the shard of the previous rank of the ring (``mirror_plan.mirror_ward``): its
rows of every parameter and of every optimizer state sharded like them. The mirror is seeded with a full copy at the end
of a resize's or recovery's reshard (at the launch generation's loop start); from then on each step costs one message
per member, its reduced gradient rows, sent to its mirror holder after the backward and **before** the step's commit
vote (a member votes only once its exchange is complete, so a committed step's gradients are in every mirror). Once the
step commits, the holder applies the optimizer's update to the mirror itself (a hook-free copy of the optimizer with the
step's hyperparameters), on a background thread that overlaps the next step's forward and backward (it is joined before
the mirror is read or fed again: the next gradient exchange, a recovery), so the mirror is the ward's state after that
step whatever the ward does next: a ward killed in its optimizer step, after it or before the next step's vote, is
restored exactly from its mirror; a ward killed before the vote leaves the step uncommitted, the mirror unchanged, and
the step is redone by the survivors. Only optimizers whose update is elementwise per parameter row can be replayed on a
shard (:data:`ELEMENTWISE_OPTIMIZERS`); with another one the job has no mirror and a death fails it with a clear
message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_elan.replication.mirror_plan import mirror_holder, mirror_ward
from lightning_elan.replication.reshard import exchange
from lightning_elan.replication.shard_layout import shard_rows

log = logging.getLogger(__name__)

__all__ = ["ELEMENTWISE_OPTIMIZERS", "PARAM", "ShardMirror", "mirrorable"]

PARAM = "param"
ELEMENTWISE_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "ASGD"})
"""``torch.optim`` optimizers whose update of a row depends on that row only (a shard's update equals its rows of the
whole tensor's update)."""

Rows = dict[str, dict[str, torch.Tensor]]
"""Per parameter name, per kind (``param``, ``o<i>/<state key>``), a shard's rows."""


def mirrorable(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """None if every optimizer can be replayed on a mirror; else why not."""
    for optimizer in optimizers:
        if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or \
                type(optimizer).__name__ not in ELEMENTWISE_OPTIMIZERS:
            return f"the optimizer {type(optimizer).__name__} is not one whose update is elementwise " \
                   f"({', '.join(sorted(ELEMENTWISE_OPTIMIZERS))} of torch.optim)"
    return None


class ShardMirror:
    """This member's copy of its ward's shard (parameters and optimizer states) and the optimizers that advance it."""

    def __init__(self) -> None:
        self._rows: Rows | None = None
        self._shadows: list[torch.optim.Optimizer] = []
        self._ward: int | None = None
        self._hyper: list[list[dict[str, Any]]] = []
        self._replay: threading.Thread | None = None  # the committed step being applied to the mirror
        self._replay_error: BaseException | None = None

    @property
    def seeded(self) -> bool:
        return self._rows is not None

    @property
    def ward(self) -> int | None:
        """The rank (in the generation that seeded it) whose shard this mirror holds."""
        return self._ward

    def rows(self) -> Rows:
        """The ward's rows, at the state after the last committed step: its parameters', and every optimizer state
        shaped like them (those the seed brought, and those the optimizers created since, e.g. Adam's moments)."""
        if self._rows is None:
            raise RuntimeError("the shard mirror was not seeded in this generation")
        self.settle()
        for index, shadow in enumerate(self._shadows):
            for kinds in self._rows.values():
                for key, value in shadow.state.get(kinds[PARAM], {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape == kinds[PARAM].shape:
                        kinds[f"o{index}/{key}"] = value
        return self._rows

    def forget(self) -> None:
        """A new generation: the layout changed; seeded again at its first step."""
        self.settle()
        self._rows, self._shadows, self._ward, self._hyper = None, [], None, []

    def seed(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], group: Any) -> int:
        """Send this member's shard to its holder, receive its ward's; returns the bytes received."""
        rank, world = group.rank(), group.size()
        ward = mirror_ward(rank, world)
        mine = _own_rows(model, optimizers)
        rows = {name: {kind: _empty_rows(parameter, world, ward) for kind in mine[name]}
                for name, parameter in model.named_parameters()}
        _exchange(group, mine, rows, mirror_holder(rank, world), ward)
        self._rows, self._ward = rows, ward
        self._shadows = [_shadow(optimizer, model, index, rows) for index, optimizer in enumerate(optimizers)]
        return sum(t.numel() * t.element_size() for kinds in rows.values() for t in kinds.values())

    def exchange_gradients(self, model: nn.Module, group: Any) -> None:
        """After the backward, before the vote: this member's reduced gradient rows to its holder, its ward's here."""
        rank, world = group.rank(), group.size()
        mine, theirs, rows = {}, {}, self.rows()
        for name, parameter in model.named_parameters():
            if parameter.grad is not None:  # unused parameters have no gradient on any member
                mine[name] = {PARAM: _local(parameter.grad)}
                theirs[name] = {PARAM: rows[name][PARAM]}
        received = {name: {PARAM: torch.empty_like(kinds[PARAM])} for name, kinds in theirs.items()}
        _exchange(group, mine, received, mirror_holder(rank, world), mirror_ward(rank, world))
        for name, kinds in theirs.items():
            kinds[PARAM].grad = received[name][PARAM]

    def capture_hyperparameters(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The step's hyperparameters (the LR ramp's scaled learning rate is in the groups while the step runs)."""
        self._hyper = [[{key: value for key, value in group.items() if key != "params"}
                        for group in optimizer.param_groups] for optimizer in optimizers]

    def advance(self, index: int, background: bool = True) -> None:
        """Optimizer ``index``'s step committed: apply it to the mirror with the ward's gradients and the step's
        hyperparameters (``background``: on a thread, joined by :meth:`settle`)."""
        self.settle()
        if not background:
            self._apply(index)
            return
        self._replay = threading.Thread(target=self._apply_catching, args=(index,), name="elan-shard-mirror",
                                        daemon=True)
        self._replay.start()

    def settle(self) -> None:
        """Wait for the step being applied to the mirror; re-raise its error."""
        if self._replay is not None:
            self._replay.join()
            self._replay = None
        if self._replay_error is not None:
            error, self._replay_error = self._replay_error, None
            raise RuntimeError("the shard mirror could not apply a committed step") from error

    def _apply_catching(self, index: int) -> None:
        try:
            self._apply(index)
        except BaseException as error:  # re-raised on the training thread by settle()
            self._replay_error = error

    def _apply(self, index: int) -> None:
        shadow = self._shadows[index]
        for group, hyper in zip(shadow.param_groups, self._hyper[index], strict=True):
            group.update(hyper)
        shadow.step()
        for kinds in self._rows.values():  # type: ignore[union-attr]
            kinds[PARAM].grad = None


def _own_rows(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Rows:
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    rows = {name: {PARAM: _local(parameter).detach()} for name, parameter in model.named_parameters()}
    for index, optimizer in enumerate(optimizers):
        for parameter, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, DTensor):
                    rows[names[id(parameter)]][f"o{index}/{key}"] = value.to_local()
    return rows


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _empty_rows(parameter: torch.Tensor, world: int, index: int) -> torch.Tensor:
    start, end = shard_rows(parameter.shape[0], world, index)
    return torch.empty((end - start, *parameter.shape[1:]), dtype=parameter.dtype, device="cpu")


def _exchange(group: Any, outgoing: Rows, incoming: Rows, holder: int, ward: int) -> None:
    """Every tensor of ``outgoing`` to ``holder``, those of ``incoming`` received from ``ward`` (the same names and
    kinds in the same order on every member), copied to the host: one all-to-all per tensor (``reshard.exchange``;
    abortable on a generation's group, where gloo's send and receive were not: a member's death left a survivor
    waiting in the mirror's exchange)."""
    keys = [(name, kind) for name, kinds in outgoing.items() for kind in kinds]
    for name, kind in keys:
        rows = outgoing[name][kind].detach().to("cpu").contiguous()
        target = incoming.get(name, {}).get(kind)
        sends = [(holder, rows)] if rows.numel() else []
        receives = [(ward, target)] if target is not None and target.numel() else []
        exchange(group, sends, receives)


def _shadow(optimizer: torch.optim.Optimizer, model: nn.Module, index: int, rows: Rows) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over the ward's rows, without hooks, with the ward's states (sharded: the mirrored
    rows; the others, e.g. Adam's ``step``, the same on every member: this member's)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    groups = [{**{key: value for key, value in group.items() if key != "params"},
               "params": [rows[names[id(parameter)]][PARAM] for parameter in group["params"]]}
              for group in optimizer.param_groups]
    shadow = type(optimizer)(groups)
    for parameter, state in optimizer.state.items():
        name = names[id(parameter)]
        shadow.state[rows[name][PARAM]] = {
            key: rows[name][f"o{index}/{key}"] if isinstance(value, DTensor) else _copied(value)
            for key, value in state.items()}
    return shadow


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value

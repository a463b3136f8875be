"""One DDP wrapper for the life of a process: gradients are all-reduced on whatever generation is current.

Modelled on torchft's ``DistributedDataParallel``: the wrapper is built once over a private one-process gloo group
(its reducer then never talks to a peer, construction runs no collective, and nothing in it is sized by the job's
world), and a communication hook sends every gradient bucket over the *current* generation's group, read at each
bucket. A resize therefore rebuilds nothing: no bucket reallocation, no parameter-shape verification, and an object a
user holds (``model = accelerator.prepare(model)``) keeps working after the job changed size.

The hook reproduces DDP's own arithmetic (each gradient multiplied by ``1 / world_size`` into its bucket, then a sum
all-reduce), so training equals a DDP run of the same world size. Buffers (e.g. batch-norm statistics) are broadcast
from rank 0 of the current generation before a forward where DDP would (``broadcast_buffers=True``) and before the
first forward of every generation.

A member's death may interrupt an iteration anywhere between its forward and the end of its backward (the gradient
all-reduce raised, or its bucket's hook found the generation failed and never launched it): the reducer then still
holds that iteration, and the next forward would fail DDP's check that the previous reduction finished.
:meth:`ElasticDistributedDataParallel.discard_iteration` puts the wrapper back where a fresh DDP starts.

DDP builds its reducer once, over the parameters that require a gradient then: a parameter unfrozen later (Lightning's
``BackboneFinetuning`` at its epoch) trains on each process's own gradient, and the ranks drift apart (Lightning issue
20340). This wrapper follows the user: before a forward where the set of trainable parameters changed, it builds its
reducer again over the parameters that require a gradient now. The reducer runs no collective, so each process does it
on its own; the processes of a job agree because they froze and unfroze the same parameters at the same step (a joiner
takes its source's ``requires_grad`` with the state).

What a one-process reducer cannot do: ``find_unused_parameters`` detects parameters unused *on this process* only
(their gradients are then zeros in the all-reduce, which is the same sum), and a user's own communication hook would
replace the one that reaches the job, so :func:`ElasticDistributedDataParallel.register_comm_hook` refuses a second.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_elan import torch_compat
from lightning_elan.elastic.process_group import group_of_this_process

log = logging.getLogger(__name__)

__all__ = ["ElasticDistributedDataParallel", "GroupSource", "freeze_as", "frozen_parameters"]

FREQUENT_REBUILDS = 10
"""After this many rebuilds of the reducer (the trainable parameters changed), a warning says what each costs."""

GroupSource = Callable[[], "dist.ProcessGroup | None"]
"""Returns the group gradients are all-reduced on now (None: this process trains alone)."""


class ElasticDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` whose gradient all-reduce follows the job's current generation.

    Args:
        module: the model (already on its device).
        current_group: returns the group of the current generation (see :data:`GroupSource`).
        **kwargs: DDP's own options (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``broadcast_buffers``, ...);
            ``process_group`` is not one of them.
    """

    def __init__(self, module: torch.nn.Module, current_group: GroupSource, **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise ValueError("ElasticDistributedDataParallel chooses its own process group (the current generation)")
        self._broadcast_live_buffers = kwargs.pop("broadcast_buffers", True)
        with warnings.catch_warnings():  # torch 2.13 prefers forward_sync_buffers; broadcast_buffers is portable
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(module, process_group=group_of_this_process(), broadcast_buffers=False, **kwargs)
        self._current_group = current_group
        self._buffers_generation: object = None  # the generation the buffers were last broadcast in
        self.failure_in_forward: Callable[[BaseException], bool] | None = None
        """A front-end that cannot catch an error of the user's forward (Accelerate's: the loop is the user's) takes a
        failed buffer broadcast here: True when it absorbed it (the step is discarded; the forward goes on with this
        process's buffers, its result unused), False to raise it."""
        self._trainable = _trainable(module)
        self._built_order = {id(parameter): index for index, parameter in enumerate(module.parameters())}
        self._rebuilds = 0
        self._fix_bucket_layout()
        super().register_comm_hook(self, _allreduce_on_current_group)
        self.register_forward_pre_hook(_follow_trainable_parameters)
        if self._broadcast_live_buffers and any(True for _ in module.buffers()):
            self.register_forward_pre_hook(_broadcast_buffers_from_rank0)

    def follow_trainable_parameters(self) -> bool:
        """Build the reducer again if the parameters that require a gradient are not those it was built over
        (returns whether it did). Gradients already held (an accumulation window) stay: with
        ``gradient_as_bucket_view`` the new buckets take them in (``Reducer::initialize_bucket_views``)."""
        trainable = _trainable(self.module)
        if trainable == self._trainable:
            return False
        if self.static_graph:
            log.warning("elastic DDP: parameters were frozen or unfrozen under static_graph=True; their gradients "
                        "are not all-reduced as they are now (the reducer of a static graph is not built again)")
            self._trainable = trainable
            return False
        torch_compat.rebuild_reducer(self, *self._reducer_parameters())
        self._trainable = trainable
        self._fix_bucket_layout()
        torch_compat.register_reducer_comm_hook(self.reducer, self, _allreduce_on_current_group)
        self._rebuilds += 1
        log.log(logging.INFO if self._rebuilds == 1 else logging.DEBUG, "elastic DDP: %d of %d parameter tensors "
                "require a gradient now; gradients are all-reduced for those", sum(trainable), len(trainable))
        if self._rebuilds == FREQUENT_REBUILDS:
            log.warning("elastic DDP: the parameters that require a gradient changed before %d forwards; each change "
                        "lays the gradient buckets out anew (an allocation of their size). A network frozen for part "
                        "of every step (a GAN's discriminator) is cheaper run outside its DDP wrapper then "
                        "(``model.module``) or kept trainable with its gradients unused", FREQUENT_REBUILDS)
        return True

    def _fix_bucket_layout(self) -> None:
        """Buckets in parameter registration order, from now on: every process of the job flattens gradients
        alike, whatever iteration its reducer is at.

        DDP rebuilds its buckets once, before the second forward, in the order gradients became ready in the first
        backward (synchronised by rank 0 over its group, here a private one). A joiner's first iteration would then
        all-reduce its initial layout against the stayers' rebuilt one — sums of mismatched elements. Pushing every
        parameter as "rebuilt" and rebuilding now (what DDP's join hook does) settles the layout at construction.
        """
        torch_compat.settle_bucket_layout(self.reducer)

    def discard_iteration(self) -> None:
        """Forget an iteration a member's death interrupted (forward done, backward or all-reduce cut short): no
        gradients, the reducer's pending reduction and per-iteration state cleared, gradient sync on, the buckets laid
        out again in the job's one layout (in new memory, where DDP rebuilds buckets at all: an abandoned all-reduce
        cannot write into them)."""
        for parameter in self.module.parameters():
            parameter.grad = None
        self.require_backward_grad_sync = True  # a no_sync() left by the error restores it too; a redo syncs
        torch_compat.reset_reducer(self.reducer)
        self._fix_bucket_layout()
        log.debug("elastic DDP: the interrupted iteration is discarded")

    def warm_up_alone(self) -> bool:
        """A joiner before its first step: one backward of zero gradients on this process alone (no forward, so no
        user code; no collective), so that the memory its first real backward writes — the gradient buckets, which the
        constructor allocates but never writes, and the gradients — has been touched before the stayers wait for it.
        The gradients are None again afterwards, as they were. Skipped (False) where it could run code of the user's
        or leave a trace: gradients already there, hooks on a parameter, ``find_unused_parameters``, a joined
        generation (the hook would all-reduce)."""
        parameters = [parameter for parameter in self.module.parameters() if parameter.requires_grad]
        if (not parameters or self.current_group() is not None or self.find_unused_parameters
                or any(parameter.grad is not None or _has_hooks(parameter) for parameter in parameters)):
            return False
        try:
            torch_compat.backward_alone(self.reducer, parameters)
        finally:
            for parameter in parameters:
                parameter.grad = None
        log.debug("elastic DDP: warmed up %d parameters' gradient buckets", len(parameters))
        return True

    def _reducer_parameters(self) -> tuple[list[torch.nn.Parameter], list[bool]]:
        """The parameters that require a gradient, in the order this wrapper was built with (the same on every
        process, whatever was re-registered since: pruning makes a parameter ``<name>_orig``, last of its module),
        each with whether it has a sparse gradient (as ``DistributedDataParallel._build_params_for_reducer``)."""
        found: dict[int, tuple[tuple[int, str], torch.nn.Parameter, bool]] = {}
        for module_name, module in self.module.named_modules():
            sparse = isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
            for name, parameter in module.named_parameters(recurse=False):
                full_name = f"{module_name}.{name}"
                ignored = full_name in self.parameters_to_ignore
                if parameter.requires_grad and not ignored and id(parameter) not in found:
                    order = (self._built_order.get(id(parameter), len(self._built_order)), full_name)
                    found[id(parameter)] = (order, parameter, sparse)
        ordered = sorted(found.values(), key=lambda entry: entry[0])
        return [parameter for _, parameter, _ in ordered], [sparse for _, _, sparse in ordered]

    def broadcast_module_state(self) -> None:
        """Rank 0's parameters and buffers on every process of the current generation (what DDP's constructor does
        with ``init_sync``; a generation formed by a replication needs none)."""
        group = self.current_group()
        if group is not None:
            _broadcast_from_rank0(group, [*self.module.parameters(), *self.module.buffers()])

    def current_group(self) -> dist.ProcessGroup | None:
        group = self._current_group()
        return group if group is not None and group.size() > 1 else None

    @override
    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        raise RuntimeError("an elastic DDP all-reduces on the current generation with its own communication hook; "
                           "another hook would bypass it")


def _trainable(module: torch.nn.Module) -> frozenset[int]:
    """Which of ``module``'s parameters require a gradient (their ids: a parameter re-registered under another name,
    as pruning does, is the same parameter)."""
    return frozenset(id(parameter) for parameter in module.parameters() if parameter.requires_grad)


def frozen_parameters(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s parameters that require no gradient (a joiner takes them with the state)."""
    return [name for name, parameter in module.named_parameters() if not parameter.requires_grad]


def freeze_as(module: torch.nn.Module, frozen: list[str]) -> None:
    """Freeze the parameters named in ``frozen`` and unfreeze the others, as on the process the list came from."""
    names = set(frozen)
    for name, parameter in module.named_parameters():
        parameter.requires_grad_(name not in names)


def _follow_trainable_parameters(model: ElasticDistributedDataParallel, inputs: Any) -> None:
    model.follow_trainable_parameters()


def _has_hooks(parameter: torch.Tensor) -> bool:
    """Whether the user registered a gradient hook on ``parameter`` (a backward would run it)."""
    return bool(getattr(parameter, "_backward_hooks", None) or getattr(parameter, "_post_accumulate_grad_hooks", None))


def _allreduce_on_current_group(model, bucket):  # no annotations: DDP checks them (strings fail)
    """DDP's arithmetic on the current group: ``grad × (1/world)`` then a sum all-reduce (a lone process: as is)."""
    buffer = bucket.buffer()
    group = model.current_group()
    if group is None:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    buffer.mul_(1.0 / group.size())
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    # the group's own method: a generation's group is not registered with torch's global group table
    work = group.allreduce([buffer], options)
    return work.get_future().then(lambda future: future.value()[0])


def _broadcast_buffers_from_rank0(model: ElasticDistributedDataParallel, inputs: Any) -> None:
    """Rank 0's buffers before a forward where DDP would broadcast them, and before the first one of a generation.

    DDP broadcasts before a forward when the previous one synchronised gradients (``require_forward_param_sync``:
    grad enabled, no ``no_sync``); the wrapper's ``training`` flag plays no part (Lightning's evaluation loops leave
    it in eval mode). A generation's first forward broadcasts on every member: a joiner has no previous forward, the
    others' may have been a validation one, and the decision must be the same on all of them or they hang.
    """
    group = model.current_group()
    generation = _generation_of(group)
    first_of_generation = generation is not model._buffers_generation
    model._buffers_generation = generation
    if group is not None and (model.require_forward_param_sync or first_of_generation):
        try:
            _broadcast_from_rank0(group, list(model.module.buffers()))
        except Exception as error:
            if model.failure_in_forward is None or not model.failure_in_forward(error):
                raise


def _generation_of(group: dist.ProcessGroup | None) -> object:
    """What identifies the generation of ``group`` (every view of one generation gives the same object)."""
    return getattr(group, "generation", group)


def _broadcast_from_rank0(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Each tensor overwritten in place by rank 0's (the group's own method: see the all-reduce hook)."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    with torch.no_grad():
        for tensor in tensors:
            group.broadcast([tensor.data], options).wait()

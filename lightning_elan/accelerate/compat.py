"""Every touch of a private Accelerate API, in one place, gated on the Accelerate versions it was read from.

Written against Accelerate 1.15 (``accelerate/state.py``, ``accelerator.py``, ``data_loader.py``). Importing this module
refuses an Accelerate outside :data:`SUPPORTED_ACCELERATE`, as ``lightning_elan.compat`` refuses an untested Lightning;
pyproject.toml's ``accelerate`` extra declares the same range.

What the elastic accelerator depends on, upstream:

* ``PartialState`` and ``AcceleratorState`` (``accelerate/state.py``) are shared-dict singletons: every instance reads
  ``_shared_state``, and ``AcceleratorState()`` copies ``PartialState``'s keys into its own dict when constructed.
  ``num_processes``, ``process_index``, ``local_process_index``, ``distributed_type``, ``backend`` and ``device``
  are plain keys there, read live by ``Accelerator`` properties, ``gather``/``reduce``, ``on_main_process`` and
  ``AcceleratedScheduler.step``. A resize writes them into both dicts.
* ``PartialState.__init__`` decides the distributed type from the torchrun variables (``LOCAL_RANK``, ``WORLD_SIZE``)
  and calls ``init_process_group`` when they say so; the elastic engine owns the default group, so the state is
  initialised without them and then set.
* ``GradientState._add_dataloader``/``_remove_dataloader`` and the ``end_of_dataloader``/``remainder`` attributes of
  the active loader tell ``accumulate()`` to synchronise at the end of an epoch (``accelerate/data_loader.py``'s
  ``DataLoaderShard`` does the same).
* ``Accelerator._dataloaders``/``_models``/``_optimizers``/``_custom_objects`` are the lists ``save_state`` and
  ``load_state`` walk.
* ``_is_accelerate_prepared`` on an object: ``prepare_model``/``prepare_optimizer``/``prepare_scheduler`` return such an
  object as it is (appending it to their list if missing) instead of wrapping it again.
* FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): ``AcceleratorState`` keeps the plugin as
  ``fsdp_plugin`` and sets ``distributed_type = FSDP`` only for the GPU-like distributed types (``state.py``: on a
  CPU, ``MULTI_CPU``, the plugin is dropped and the model is wrapped in DDP, silently); ``Accelerator.is_fsdp2`` reads
  both live. ``Accelerator.prepare`` then runs ``_prepare_fsdp2``: optimizers and schedulers prepared first, the model
  given to ``utils/fsdp_utils.fsdp2_prepare_model``, which imports ``fully_shard`` from ``torch.distributed.fsdp``
  when called and applies it to the units its auto-wrap policy picks, the embedding and tail units, then the root
  (``mesh=None`` without a ``parallelism_config``: torch's default mesh); the optimizers' parameters are then switched
  to the sharded ones by name.
* ``PartialState.wait_for_everyone`` is Accelerate's one barrier: ``Accelerator.wait_for_everyone`` reaches it through
  ``utils.wait_for_everyone``, and so do ``main_process_first``/``local_main_process_first`` (``_goes_first``: the
  others wait before the block, the main process after it), ``AcceleratorState.wait_for_everyone``, the in-order
  ``get_logger(...).info(..., in_order=True)`` and the user's ``PartialState().wait_for_everyone()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from importlib.metadata import version as _installed_version
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

log = logging.getLogger(__name__)

SUPPORTED_ACCELERATE = ">=1.0,<1.16"
"""``accelerate`` versions whose private behaviour this module relies on (the upper bound: the newest minor CI tested,
constraints-ci.txt; pre-releases of 1.16 are outside it, as pip's ``<1.16`` excludes them)."""


def check_accelerate_version(installed: str) -> None:
    """Refuse an Accelerate whose internals this module was not written against (fails at import, with the range)."""
    if not SpecifierSet(SUPPORTED_ACCELERATE).contains(Version(installed), prereleases=True):
        raise ImportError(f"lightning_elan's Accelerate integration supports accelerate{SUPPORTED_ACCELERATE}; found "
                          f"accelerate {installed}. Install a supported version "
                          f"(pip install 'accelerate{SUPPORTED_ACCELERATE}').")


check_accelerate_version(_installed_version("accelerate"))

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_CPU")


@contextlib.contextmanager
def single_process_initialisation() -> Iterator[None]:
    """While ``Accelerator.__init__`` creates the state singletons: no torchrun variables, so ``PartialState`` neither
    initialises a process group nor picks a distributed type (the elastic accelerator sets both afterwards)."""
    saved = {name: os.environ.pop(name) for name in _LAUNCHER_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def distributed_type_for(device: torch.device, sharded: bool = False) -> DistributedType:
    """A member's distributed type: ``FSDP`` for a job sharded with FSDP2 (so ``is_fsdp2``, ``save_state`` and
    ``load_state`` take Accelerate's FSDP2 paths, on a CPU too), else the data-parallel type of its device."""
    if sharded:
        return DistributedType.FSDP
    return DistributedType.MULTI_GPU if device.type == "cuda" else DistributedType.MULTI_CPU


_OUTSIDE_THE_JOB = "_elan_outside_the_job"
"""A key of the state singletons' shared dicts: True on a joiner warming up (not admitted yet) and on a worker that left
the job. Both are single-process states (``DistributedType.NO``, so Accelerate's collectives are local)."""

_PROCESS_DECORATORS = ("on_main_process", "on_local_main_process", "on_last_process", "on_process", "on_local_process")


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _outside_the_job(function: Any) -> Any:
    """``PartialState.on_main_process`` (and its siblings) run the function on any process whose state is not
    distributed (``if self.is_main_process or not self.use_distributed``): on a joiner warming up and on a worker that
    left, which are no process of the job. There they do nothing: ``Accelerator.init_trackers``/``log`` and every
    tracker's ``@on_main_process`` methods (a second tracker run, say), and the user's
    ``@accelerator.on_main_process`` functions. ``function`` is the upstream method (accelerate/state.py)."""
    def guarded(self: PartialState, *args: Any, **kwargs: Any) -> Any:
        decorated = function(self, *args, **kwargs)
        if not self._shared_state.get(_OUTSIDE_THE_JOB) or not callable(decorated):
            return decorated
        if isinstance(decorated, functools.partial) and decorated.func.__name__ == function.__name__:
            return decorated  # on_process()/on_local_process() called without the function: decorated later
        return _do_nothing

    guarded._elan_guard = True  # type: ignore[attr-defined]
    return functools.wraps(function)(guarded)


def guard_process_decorators() -> None:
    """Install :func:`_outside_the_job` on ``PartialState``'s decorators (once)."""
    for name in _PROCESS_DECORATORS:
        method = getattr(PartialState, name)
        if not getattr(method, "_elan_guard", False):
            setattr(PartialState, name, _outside_the_job(method))


_elastic_barrier: list[weakref.WeakMethod] = []
"""The live elastic accelerator's ``wait_for_everyone`` (a weak reference; not in ``PartialState``'s shared dict,
whose emptiness tells Accelerate the state is not initialised yet)."""


def route_state_barriers(barrier: Callable[[], None]) -> None:
    """Every barrier of Accelerate's state singletons (``main_process_first``, ``utils.wait_for_everyone``, the
    user's ``PartialState().wait_for_everyone()``) runs ``barrier``, the elastic accelerator's: a joiner warming up
    waits there until the members are in their training loop (so what the main process prepared in its
    ``main_process_first`` block exists), a member's death is recovered from. ``barrier`` calls :func:`state_barrier`
    for Accelerate's own."""
    _elastic_barrier[:] = [weakref.WeakMethod(barrier)]  # type: ignore[arg-type]
    upstream = PartialState.wait_for_everyone
    if getattr(upstream, "_elan_upstream", None) is not None:
        return

    def routed(self: PartialState) -> None:
        elastic = _elastic_barrier[0]() if _elastic_barrier else None
        if elastic is None:
            return upstream(self)
        return elastic()

    routed._elan_upstream = upstream  # type: ignore[attr-defined]
    PartialState.wait_for_everyone = functools.wraps(upstream)(routed)  # type: ignore[method-assign]


def state_barrier() -> None:
    """Accelerate's own barrier, as upstream wrote it (``torch.distributed.barrier`` of a distributed state, else
    nothing)."""
    method = PartialState.wait_for_everyone
    getattr(method, "_elan_upstream", method)(PartialState())


def watch_local_sgd() -> None:
    """Tell the elastic accelerator when a ``LocalSGD`` is entered and exited (once). Upstream
    (``accelerate/local_sgd.py``): ``LocalSGD.__init__`` keeps the accelerator in ``self.accelerator`` only when
    enabled, ``step()`` counts in ``self.num_steps`` and averages the models whenever
    ``num_steps % local_sgd_steps == 0``."""
    from accelerate.local_sgd import LocalSGD

    if getattr(LocalSGD.__enter__, "_elan_watch", False):
        return
    enter, exit_ = LocalSGD.__enter__, LocalSGD.__exit__

    def watched_enter(self: LocalSGD) -> LocalSGD:
        result = enter(self)
        steps = getattr(getattr(self, "accelerator", None), "local_sgd_steps_state", None)
        if steps is not None:
            steps.entered(self)
        return result

    def watched_exit(self: LocalSGD, *exc: Any) -> Any:
        steps = getattr(getattr(self, "accelerator", None), "local_sgd_steps_state", None)
        if steps is not None:
            steps.exited(self)
        return exit_(self, *exc)

    watched_enter._elan_watch = True  # type: ignore[attr-defined]
    LocalSGD.__enter__, LocalSGD.__exit__ = watched_enter, watched_exit  # type: ignore[method-assign]


def set_process_state(
    distributed: bool, device: torch.device, backend: str | None, num_processes: int, process_index: int,
    outside_the_job: bool = False, sharded: bool = False,
) -> None:
    """Write this process's place in the job into both state singletons (read live everywhere in Accelerate);
    ``outside_the_job``: a joiner warming up or a worker that left (``on_main_process`` functions do nothing);
    ``sharded``: a member of a job sharded with FSDP2."""
    values = {
        _OUTSIDE_THE_JOB: outside_the_job,
        "distributed_type": distributed_type_for(device, sharded) if distributed else DistributedType.NO,
        "backend": backend if distributed else None,
        "device": device,
        "num_processes": num_processes,
        "process_index": process_index,
        "local_process_index": process_index,  # one host per job for now: the local index is the rank
    }
    PartialState._shared_state.update(values)
    if AcceleratorState._shared_state:
        AcceleratorState._shared_state.update(values)


@contextlib.contextmanager
def reported_num_processes(num_processes: int) -> Iterator[None]:
    """``AcceleratedScheduler.step`` steps its scheduler ``AcceleratorState().num_processes`` times per optimizer step:
    report a fixed count (the launch world) so a resize does not change the LR schedule. ``AcceleratorState()``
    copies ``PartialState``'s keys when constructed: both dicts report it."""
    states = (PartialState._shared_state, AcceleratorState._shared_state)
    live = [state["num_processes"] for state in states]
    for state in states:
        state["num_processes"] = num_processes
    try:
        yield
    finally:
        for state, value in zip(states, live, strict=True):
            state["num_processes"] = value


def is_prepared(obj: object) -> bool:
    """Whether Accelerate treats ``obj`` as already prepared (its ``prepare_*`` methods return it as it is)."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def mark_prepared(obj: Any) -> None:
    """Mark ``obj`` as prepared, as ``Accelerator.prepare_model`` marks the model it returns."""
    obj._is_accelerate_prepared = True


def enter_dataloader(loader: object) -> None:
    GradientState()._add_dataloader(loader)


def leave_dataloader(loader: object) -> None:
    GradientState()._remove_dataloader(loader)


def shard_for_evaluation(accelerator: Accelerator, loader: DataLoader) -> Any:
    """Accelerate's own sharded loader for the world of now (not kept in the accelerator's list of loaders)."""
    with _whole_batches_if_unsplittable(accelerator, loader):
        sharded = Accelerator.prepare_data_loader(accelerator, loader)
    accelerator._dataloaders.remove(sharded)
    return sharded


@contextlib.contextmanager
def _whole_batches_if_unsplittable(accelerator: Accelerator, loader: DataLoader) -> Iterator[None]:
    """``split_batches=True`` and a batch size the world of now does not divide (a resize made it): Accelerate's
    ``BatchSamplerShard`` raises ``ValueError`` (``accelerate/data_loader.py``), which ``prepare()`` at launch never
    did. Shard that evaluation loader the way ``split_batches=False`` does instead: whole batches round robin, the
    last ones padded, ``gather_for_metrics`` dropping the padding; every sample is evaluated once all the same.
    ``Accelerator.split_batches`` reads ``dataloader_config.split_batches`` live (``accelerate/accelerator.py``)."""
    config = accelerator.dataloader_config
    batch_size = getattr(loader, "batch_size", None)
    world = accelerator.num_processes
    if not config.split_batches or batch_size is None or batch_size % world == 0:
        yield
        return
    log.info("evaluation DataLoader: its batch size %d does not split over %d processes (split_batches=True); each "
             "process evaluates whole batches of it instead", batch_size, world)
    config.split_batches = False
    try:
        yield
    finally:
        config.split_batches = True


def replace_prepared(items: list[Any], old: Any, new: Any) -> None:
    """Swap ``old`` for ``new`` in one of the accelerator's lists of prepared objects."""
    items[next(index for index, item in enumerate(items) if item is old)] = new


def prepared_models(accelerator: Accelerator) -> list[torch.nn.Module]:
    return accelerator._models


def prepared_optimizers(accelerator: Accelerator) -> list[Any]:
    return accelerator._optimizers


def prepared_schedulers(accelerator: Accelerator) -> list[Any]:
    return accelerator._schedulers


def prepared_dataloaders(accelerator: Accelerator) -> list[Any]:
    return accelerator._dataloaders


def checkpointed_objects(accelerator: Accelerator) -> list[Any]:
    """Objects registered with ``register_for_checkpointing``."""
    return accelerator._custom_objects


def latest_checkpoint_dir(accelerator: Accelerator) -> str:
    """The folder ``load_state()`` without an argument reads (automatic checkpoint naming: the highest number)."""
    base = os.path.join(accelerator.project_dir, "checkpoints")
    folders = [os.path.join(base, name) for name in os.listdir(base)]
    return max(folders, key=lambda folder: int("".join(ch for ch in os.path.basename(folder) if ch.isdigit()) or 0))


def keep_fsdp_plugin(plugin: Any) -> None:
    """Keep the FSDP2 plugin in ``AcceleratorState`` (``state.fsdp_plugin``, read by ``is_fsdp2``,
    ``fsdp2_prepare_model``, ``save_state``/``load_state``): ``AcceleratorState.__init__`` keeps it only for the
    GPU-like distributed types, never for the single-process state the elastic accelerator is initialised in."""
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


@contextlib.contextmanager
def preparing_as_fsdp2() -> Iterator[None]:
    """While ``Accelerator.prepare`` runs on a process outside the job (a joiner warming up: ``DistributedType.NO``),
    the state says ``FSDP``, so ``prepare`` takes its FSDP2 path (``if self.is_fsdp2: ... _prepare_fsdp2``) and the
    model and optimizer are prepared as the members' were."""
    states = (PartialState._shared_state, AcceleratorState._shared_state)
    saved = [state["distributed_type"] for state in states]
    for state in states:
        state["distributed_type"] = DistributedType.FSDP
    try:
        yield
    finally:
        for state, value in zip(states, saved, strict=True):
            state["distributed_type"] = value


FullyShard = Callable[..., Any]
"""``torch.distributed.fsdp.fully_shard``'s signature: ``(module or modules, *, mesh=..., **options)``."""


@contextlib.contextmanager
def fully_shard_replaced(replacement_of: Callable[[FullyShard], FullyShard]) -> Iterator[None]:
    """Within, ``fsdp2_prepare_model`` (``accelerate/utils/fsdp_utils.py``, which imports ``fully_shard`` from
    ``torch.distributed.fsdp`` each time it is called) calls ``replacement_of(torch's fully_shard)`` instead."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard
    fsdp.fully_shard = replacement_of(original)
    try:
        yield
    finally:
        fsdp.fully_shard = original

"""Every touch of a private Lightning API, in one place, gated on the Lightning version it was read from.

Each function names the upstream behaviour it depends on (lightning 2.4–2.6, ``lightning.pytorch``).
"""

from __future__ import annotations

import copy
import functools
import logging
import signal
import threading
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from importlib.metadata import version as _installed_version
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.callbacks.progress import ProgressBar, TQDMProgressBar
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import _TunerExitException
from lightning.pytorch.utilities.model_helpers import is_overridden
from packaging.version import Version
from torchmetrics import Metric

from lightning_elan.kept_attributes import KeptAttributes

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

SUPPORTED_LIGHTNING = (Version("2.4.0"), Version("2.7.0"))
"""``lightning`` versions whose private behaviour this module was read from: ``>=2.4,<2.7``."""


def check_lightning_version(installed: str) -> None:
    """Refuse a Lightning whose internals this module was not written against (fails at import, with the range)."""
    low, high = SUPPORTED_LIGHTNING
    if not low <= Version(installed) < high:
        raise ImportError(f"lightning_elan supports lightning>={low},<{high}; found lightning {installed}. Install a "
                          f"supported version (pip install 'lightning>={low},<{high}').")


check_lightning_version(_installed_version("lightning"))


class LeaveFit(_TunerExitException):
    """Raised in a leaver: Lightning's ``_call_and_handle_interrupt`` treats ``_TunerExitException`` as a normal end —
    teardown runs, loggers finalise with "success", ``fit()`` returns, no ``on_exception`` hooks."""


def end_the_script_after_a_leavers_fit() -> None:
    """Call ``trainer.strategy.fit_returned()`` (when the strategy has it) each time ``Trainer.fit`` has returned.

    A leaver's ``fit`` ends with ``LeaveFit``, which ``_call_and_handle_interrupt`` takes as a normal end (teardown,
    loggers finalised with "success", ``fit()`` returns). Any other ``BaseException`` raised inside ``fit`` (a
    ``SystemExit`` included) goes to its ``except BaseException``: ``_interrupt`` runs the ``on_exception`` hooks and
    ``logger.finalize("failed")``. So the leaver's end of its script (``fit_returned`` raises ``SystemExit(0)``) is
    raised outside ``Trainer.fit``'s own code, once it returned: ``Trainer.fit`` is wrapped, once per class tree (the
    call ``Trainer.fit`` makes is its last statement in lightning 2.4–2.6)."""
    from lightning.pytorch import Trainer

    fit = Trainer.fit
    if getattr(fit, "_elan_ends_leavers", False):
        return

    @functools.wraps(fit)
    def fit_then_end_a_leaver(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        fit(trainer, *args, **kwargs)
        fit_returned: Callable[[], None] | None = getattr(trainer.strategy, "fit_returned", None)
        if fit_returned is not None:
            fit_returned()

    fit_then_end_a_leaver._elan_ends_leavers = True  # type: ignore[attr-defined]
    Trainer.fit = fit_then_end_a_leaver  # type: ignore[method-assign]


def keep_sigterm_handler(trainer: pl.Trainer, handler: Callable[[], Any]) -> None:
    """Keep elan's SIGTERM handler (``handler()``; None: none installed) once Lightning has installed its own.

    ``Trainer._run`` calls ``_SignalConnector.register_signal_handlers`` after ``strategy.setup`` and the restore of
    the training state; it installs ``_HandlersCompose([_sigterm_notifier_fn, <the handler found>])``. The notifier
    broadcasts on the default group from inside the signal handler (a collective the other ranks are not in: it
    deadlocks a worker signalled mid-collective, see docs/benchmarks.md) and sets ``received_sigterm``, which the
    training loops turn into ``SIGTERMException`` on that rank alone. In an elastic job SIGTERM means *leave at the next
    batch boundary* (``elastic/termination.py``), so elan's handler is put back right after Lightning's registration.
    ``_SignalConnector.teardown`` restores the handlers found at registration: elan's again, disarmed by then.
    """
    connector = trainer._signal_connector
    if getattr(connector, "_elan_keeps_sigterm", False):
        return
    register = type(connector).register_signal_handlers

    def register_signal_handlers() -> None:
        register(connector)
        own = handler()
        if own is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, own)

    connector.register_signal_handlers = register_signal_handlers
    connector._elan_keeps_sigterm = True


def drop_sigterm_broadcast(trainer: pl.Trainer) -> bool:
    """Skip Lightning's per-batch broadcast of its SIGTERM flag; return whether there was one to skip.

    ``_TrainingEpochLoop.advance`` calls ``_broadcast_sigterm_tensor`` before every batch of a distributed run: rank 0's
    ``trainer.received_sigterm`` on the default group, ``SIGTERMException`` on every rank when it is set. Under
    ``elan run`` that flag is never set (``keep_sigterm_handler`` keeps Lightning's notifier out; off the main thread
    neither handler is installed), so the broadcast always carries 0; the engine's per-boundary leave all-reduce takes
    its place, and a step keeps the collective count of Lightning's DDP. Every worker of the job drops it (the
    decision depends only on running under ``elan run``), so the collectives stay paired. Lightning versions without
    the broadcast have nothing to skip.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(type(epoch_loop), "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = lambda: None
    return True


def collective_settings(strategy: Any) -> tuple[str, Any]:
    """The process-group backend and collective timeout ``DDPStrategy.setup_distributed`` would use: it sets
    ``_process_group_backend`` from ``_get_process_group_backend()`` (which the strategy's ``process_group_backend``
    property then answers) and passes ``_timeout``."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    return strategy._process_group_backend, strategy._timeout


def disable_distributed_sampler(trainer: pl.Trainer) -> bool:
    """Stop Lightning from injecting a ``DistributedSampler`` into the loaders of ``fit``, ``validate`` and ``test``
    (the strategy shards them itself, over the members of the moment); return the user's setting.

    ``_DataConnector._requires_distributed_sampler`` reads ``_accelerator_connector.use_distributed_sampler``. For
    ``trainer.predict`` (``trainer.state.fn`` is set before the strategy's ``setup_environment``) the user's setting
    stands: Lightning's own injection wraps the sampler in an ``UnrepeatedDistributedSamplerWrapper``
    (``_get_distributed_sampler``), so each sample is predicted once over the processes, as under DDP (the world does
    not change during a prediction).
    """
    connector = trainer._accelerator_connector
    user_setting = bool(getattr(connector, "_elan_user_distributed_sampler", connector.use_distributed_sampler))
    connector._elan_user_distributed_sampler = user_setting
    connector.use_distributed_sampler = user_setting and trainer.state.fn == TrainerFn.PREDICTING
    return user_setting


def user_wants_distributed_sampler(trainer: pl.Trainer) -> bool:
    """The user's ``use_distributed_sampler`` as :func:`disable_distributed_sampler` found it."""
    return bool(getattr(trainer._accelerator_connector, "_elan_user_distributed_sampler", True))


def evaluation_sampler(dataloader: Any, world_size: int, rank: int) -> Any:
    """The sampler of an evaluation loader's shard, as Lightning's DDP injects it (``_get_distributed_sampler`` in
    ``lightning/pytorch/trainer/connectors/data_connector.py``; unshuffled): a ``DistributedSampler`` of the dataset
    where the loader's sampler is a ``RandomSampler``/``SequentialSampler``, else Lightning's
    ``DistributedSamplerWrapper`` around the user's sampler, sharding what it yields (a ``SubsetRandomSampler`` of the
    validation indices keeps to them; a ``DistributedSampler`` of the whole dataset evaluated the training samples
    too)."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    if isinstance(dataloader.sampler, (RandomSampler, SequentialSampler)):
        return DistributedSampler(dataloader.dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DistributedSamplerWrapper(dataloader.sampler, num_replicas=world_size, rank=rank, shuffle=False)


def with_sampler(dataloader: Any, sampler: Any, stage: Any) -> Any:
    """The user's loader re-built around ``sampler`` (``lightning.pytorch.utilities.data._update_dataloader``, what
    Lightning's own sampler injection uses: it re-runs the loader's constructor with the captured arguments)."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=stage)


def dump_training_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's full checkpoint dict, in memory (``_CheckpointConnector.dump_checkpoint``)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def stage_training_state(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Hand an in-memory checkpoint to Lightning's restore path, from inside ``strategy.setup``.

    ``Trainer._run`` calls ``restore_training_state()`` (loops, optimizers, schedulers, precision) right after
    ``strategy.setup`` and ``on_fit_start``; it reads ``_CheckpointConnector._loaded_checkpoint``. Callbacks and the
    datamodule are restored here, as ``_restore_modules_and_callbacks`` would have done before setup.
    """
    _count_the_epoch_in_progress(checkpoint)
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    connector.restore_datamodule()
    connector.restore_callbacks()


def _count_the_epoch_in_progress(checkpoint: dict[str, Any]) -> None:
    """A mid-epoch state whose ``epoch_progress`` does not count the epoch in progress as started: restored, it would
    not restart mid-epoch, and the joiner would run the epoch from its first batch while the members are in it.

    ``_FitLoop.update_restart_stage`` tells a mid-epoch restart by ``epoch_progress.total`` with ``started ==
    processed + 1`` (``advance`` increments ``ready``/``started`` as an epoch starts, ``processed`` as it ends). A loop
    that resumed from a checkpoint saved on an epoch's last batch (``RESTARTED_ON_LAST``: ``ModelCheckpoint`` every N
    steps on an epoch's end, or ``save_last``) goes on into the next epochs without that increment (Lightning 2.6.6):
    mid-epoch, its ``started`` equals ``processed``. The joiner's restore then sets the epoch loop's batch progress
    to the epoch's start (``_TrainingEpochLoop.reset``): its ``batch_idx`` lags the members', it misses the epoch's last
    batch and the validation after it, and the job hangs there. Counted here as Lightning counts a running epoch."""
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if not loops or "epoch_progress" not in loops or "epoch_loop.batch_progress" not in loops:
        return
    batches = loops["epoch_loop.batch_progress"]["current"]
    for tracker in (loops["epoch_progress"]["total"], loops["epoch_progress"]["current"]):
        if 0 < batches["ready"] and tracker["started"] == tracker["processed"] == tracker["completed"]:
            tracker["ready"] = tracker["started"] = tracker["processed"] + 1


def call_on_load_checkpoint(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """The LightningModule's ``on_load_checkpoint`` hook, as ``_CheckpointConnector.restore_model`` calls it."""
    from lightning.pytorch.trainer import call

    call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)


def follow_fit_loop_restores(trainer: pl.Trainer, restored: Callable[[int, bool], None]) -> None:
    """Call ``restored(epoch, with_loader_state)`` each time Lightning loads the fit loop's state.

    ``_CheckpointConnector.restore_loops`` loads it with ``fit_loop.load_state_dict`` (progress first, then
    ``_FitLoop.on_load_checkpoint``, which keeps the saved loaders' states in ``_combined_loader_states_to_load``). The
    LR finder (``tuner/lr_finder.py`` ``_lr_find``) loads the state it dumped before its range test and restores its
    checkpoint, then sets ``fit_loop.restarting = False``: ``_FitLoop._load_combined_loader_states`` then applies no
    loader state, and Lightning's next loader iterator starts ``epoch`` from its first batch.
    """
    fit_loop = trainer.fit_loop
    if getattr(fit_loop, "_elan_restored", None) is restored:
        return
    load = type(fit_loop).load_state_dict

    def load_state_dict(state_dict: dict, prefix: str = "") -> None:
        load(fit_loop, state_dict, prefix)
        restored(fit_loop.epoch_progress.current.processed, bool(fit_loop._combined_loader_states_to_load))

    fit_loop.load_state_dict = load_state_dict
    fit_loop._elan_restored = restored


def tuning(trainer: pl.Trainer) -> bool:
    """This ``fit`` is ``Tuner.lr_find``'s: it runs only the LR finder's range test (``tuner/tuning.py`` adds a
    ``LearningRateFinder`` with ``_early_exit = True``, which raises ``_TunerExitException`` after the test)."""
    from lightning.pytorch.callbacks import LearningRateFinder

    return any(isinstance(callback, LearningRateFinder) and getattr(callback, "_early_exit", False)
               for callback in trainer.callbacks)


LRFindRunner = Callable[..., Any]
"""``run(lr_find, trainer, model, **options)``: runs (or stands in for) Lightning's ``_lr_find``."""


def route_lr_find() -> None:
    """Send every LR range test through its trainer's strategy when the strategy has ``run_lr_find(lr_find, trainer,
    model, **options)`` (``LearningRateFinder.lr_find`` calls ``callbacks/lr_finder.py``'s ``_lr_find``, and
    ``Tuner.lr_find`` runs that callback); other strategies get Lightning's own."""
    from lightning.pytorch.callbacks import lr_finder as callback_module

    lr_find = callback_module._lr_find
    if getattr(lr_find, "_elan_routed", False):
        return

    def routed(trainer: pl.Trainer, model: pl.LightningModule, **options: Any) -> Any:
        run: LRFindRunner | None = getattr(trainer.strategy, "run_lr_find", None)
        return lr_find(trainer, model, **options) if run is None else run(lr_find, trainer, model, **options)

    routed._elan_routed = True  # type: ignore[attr-defined]
    callback_module._lr_find = routed


def lr_find_results(finder: Any) -> dict[str, Any] | None:
    """What an ``_LRFinder`` found (its ``results`` and ``_total_batch_idx``; None: the test was skipped)."""
    if finder is None:
        return None
    return {"results": finder.results, "total_batch_idx": finder._total_batch_idx}


def lr_finder_from_results(trainer: pl.Trainer, model: pl.LightningModule, found: dict[str, Any] | None,
                           options: dict[str, Any]) -> Any:
    """The ``_LRFinder`` that ``_lr_find(trainer, model, **options)`` returns, made from another process's ``found``,
    with ``_lr_find``'s ``update_attr`` applied (the model's LR attribute and its optimizers' LR set to the
    suggestion)."""
    from lightning.pytorch.tuner.lr_finder import _determine_lr_attr_name, _LRFinder
    from lightning.pytorch.utilities.parsing import lightning_setattr

    if found is None:
        return None
    finder = _LRFinder(options.get("mode", "exponential"), options.get("min_lr", 1e-8), options.get("max_lr", 1.0),
                       options.get("num_training", 100))
    finder.results, finder._total_batch_idx = found["results"], found["total_batch_idx"]
    suggestion = finder.suggestion() if options.get("update_attr", False) else None
    if suggestion is not None:
        lightning_setattr(model, _determine_lr_attr_name(model, options.get("attr_name", "")), suggestion)
        for optimizer in trainer.optimizers or []:
            for group in optimizer.param_groups:
                group["lr"] = suggestion
    return finder


@contextmanager
def module_kept_off_the_cpu(module: torch.nn.Module) -> Generator[None, None, None]:
    """Lightning's ``Strategy.teardown`` moves the LightningModule to the CPU (``self.lightning_module.cpu()``,
    lightning/pytorch/strategies/strategy.py); a joiner that fails before its shards arrive still has meta parameters,
    which cannot be copied ("Cannot copy out of meta tensor"): that move is skipped, so the teardown does not raise over
    the failure that ended the fit."""
    module.cpu = lambda: module  # an instance attribute shadows the method for this teardown only
    try:
        yield
    finally:
        del module.cpu


@contextmanager
def after_the_closure(precision: Any, hook: Callable[[], None]) -> Generator[None, None, None]:
    """While the context is open, ``hook`` runs each time Lightning has run a step's closure and what follows it,
    before the optimizer's update: ``Precision._wrap_closure`` (lightning/pytorch/plugins/precision/precision.py; the
    AMP, FSDP and DeepSpeed plugins call the same ``_after_closure`` themselves) runs the closure (``training_step``
    and backward), then ``_after_closure``: the ``on_before_optimizer_step`` hooks and ``_clip_gradients``."""
    after_closure = precision._after_closure

    def then_hook(model: Any, optimizer: Any) -> None:
        after_closure(model, optimizer)
        hook()

    precision._after_closure = then_hook  # an instance attribute shadows the method while the step runs
    try:
        yield
    finally:
        del precision._after_closure


def materialize_meta_module(module: torch.nn.Module, device: torch.device) -> None:
    """A module built on the meta device given memory on ``device`` and initialised by each submodule's
    ``reset_parameters``, as Lightning's ``ModelParallelStrategy.setup`` does (``_materialize_distributed_module``,
    lightning/fabric/utilities/init.py: ``to_empty`` on the root, as FSDP2's ``FSDPModule._apply`` needs, then every
    submodule with parameters or buffers resets them; a warning names those without ``reset_parameters``). Sharded
    units are materialised shard by shard.

    Unlike Lightning (its TODO there: torchmetrics is not compatible with ``to_empty``), the torchmetrics metrics of
    the module keep their states: ``Metric._apply`` takes ``to_empty`` to its states and to the defaults its ``reset``
    restores, so a metric made in ``__init__`` would compute from uninitialised memory in every epoch."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    kept = [(metric, _real_metric_states(metric)) for metric in module.modules() if isinstance(metric, Metric)]
    _materialize_distributed_module(module, device)
    for metric, (defaults, states) in kept:
        metric._defaults.update(defaults)
        for name, value in states.items():
            setattr(metric, name, value)
        metric.to(device)


def _real_metric_states(metric: Metric) -> tuple[dict[str, Any], dict[str, Any]]:
    """A metric's defaults and current states that are not on the meta device (a metric built there has none to
    keep), copied: torchmetrics keeps them in ``_defaults`` and as attributes of those names."""

    def real(value: Any) -> bool:
        return not any(tensor.is_meta for tensor in (value if isinstance(value, list) else [value])
                       if isinstance(tensor, torch.Tensor))

    defaults = {name: copy.deepcopy(value) for name, value in metric._defaults.items() if real(value)}
    return defaults, {name: copy.deepcopy(getattr(metric, name)) for name in defaults if real(getattr(metric, name))}


def call_after_each_trained_batch(trainer: pl.Trainer, hook: Callable[[], None]) -> None:
    """Run ``hook`` once a training batch is completely over, after every hook Lightning runs for it.

    ``_TrainingEpochLoop.run`` calls ``advance`` (training step, callbacks' then the LightningModule's
    ``on_train_batch_end``, ``batch_progress.increment_completed``) and then ``on_advance_end`` (the batch's
    validation, plateau schedulers, ``_batches_that_stepped``, logger saving) for every batch; ``hook`` runs at the
    end of ``on_advance_end``. A checkpoint dumped there restores as Lightning's ``RESTARTED_ON_LAST`` stage, which
    counts the batch as completed and does not count ``_batches_that_stepped`` twice.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if getattr(epoch_loop, "_elan_after_batch", None) is hook:
        return
    run_batch_end = type(epoch_loop).on_advance_end

    def on_advance_end(data_fetcher: Any) -> None:
        if getattr(epoch_loop, "_elan_discarded", False):  # see redo_interrupted_batches
            epoch_loop._elan_discarded = False
            return
        try:
            run_batch_end(epoch_loop, data_fetcher)  # a death in its validation: see redo_validation_cut_by_a_death
        except _WindowRedone:
            return  # the batch's step is redone from its window's first batch: the rest of its end with it
        hook()

    epoch_loop.on_advance_end = on_advance_end
    epoch_loop._elan_after_batch = hook


def undo_an_interrupted_forward_redirection(module: torch.nn.Module) -> None:
    """Lightning's ``_ForwardRedirection.__call__`` (``Strategy.training_step`` & co. when ``strategy.model`` is not
    the LightningModule) sets ``module.forward`` to its ``wrapped_forward`` closure and calls the wrapper; the closure
    puts the original ``forward`` back (its cell ``original_forward``) only once the wrapper's call reaches it. An
    error raised before that (a member's death in FSDP2's pre-forward all-gather, or in DDP's broadcast of the buffers
    before its forward) leaves the closure in place, and the redone step's ``self(x)`` would call
    ``training_step(x)``. Puts the original ``forward`` back if so."""
    patched = module.__dict__.get("forward")
    if patched is None or not getattr(patched, "__qualname__", "").endswith(
            "_ForwardRedirection.__call__.<locals>.wrapped_forward"):
        return
    cells = dict(zip(patched.__code__.co_freevars, patched.__closure__ or (), strict=True))
    module.forward = cells["original_forward"].cell_contents


def redo_interrupted_batches(
    trainer: pl.Trainer, recover: Callable[[BaseException, Callable[[], None] | None], bool]
) -> None:
    """Let an error escaping a training batch go to ``recover(error, rollback)`` instead of ending ``fit``.

    ``recover`` re-raises what is not a member's death; it calls ``rollback`` when the batch's step was not committed
    (the batch is then redone: its progress counters and the fetcher's count go back to where the batch began), and
    returns whether it did. ``_TrainingEpochLoop.advance`` runs one batch: ``next(data_fetcher)`` (the prefetcher
    fetches one ahead and counts ``fetched``), ``batch_progress.increment_ready/started``, the optimization (the
    optimizer loop's ``optim_progress``: step ``ready`` before the optimizer step, ``completed`` after it), then
    ``increment_processed``, the step's LR schedulers, the ``on_train_batch_end`` hooks and ``increment_completed``.
    A discarded batch also skips its ``on_advance_end`` (validation, ``_batches_that_stepped``, logger save).

    With ``accumulate_grad_batches`` > 1 the batch rolled back to is the first of the interrupted step's accumulation
    window: ``_AutomaticOptimization`` opens a window (zeroes the gradients) at a ``batch_idx`` divisible by it, and the
    upcoming batch's ``batch_idx`` is ``batch_progress.current.ready`` (``advance`` computes ``self.batch_idx + 1``).
    The window's micro-batches that completed before the death are trained again, so their hooks (a callback's
    ``on_train_batch_end``) run again: their logged values, torchmetrics and logger rows are rewound, and so are the
    user's attributes (:func:`kept_user_attributes`; docs/architecture.md, *Worker failures*).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if getattr(epoch_loop, "_elan_recover", None) is recover:
        return
    run_batch = type(epoch_loop).advance
    window: dict[str, Any] = {}
    logs = _WindowLogs(trainer, lambda: epoch_loop.batch_progress.total.ready)
    epoch_loop._elan_window_logs = logs

    def advance(data_fetcher: Any) -> None:
        if not window or epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0:
            window.update(_progress_state(epoch_loop, data_fetcher),
                          metrics=_metric_states(trainer, epoch_loop._results),
                          buffers=_buffer_states(trainer.lightning_module),
                          attributes=kept_user_attributes(trainer))
        saved = dict(window)
        epoch_loop._elan_discarded = False
        logs.holding = True
        rewind = functools.partial(_rewind_window, trainer, data_fetcher, saved)
        try:
            run_batch(epoch_loop, data_fetcher)
        except StopIteration:  # the epoch ends: its data ran out, or ``on_train_batch_start`` returned -1
            logs.window_done(discarded=False, closed=True)
            raise
        except Exception as error:
            epoch_loop._elan_discarded = recover(error, rewind)
        open_window = not epoch_loop._elan_discarded and accumulating(trainer)
        epoch_loop._elan_rewind_open_window = rewind if open_window else None
        logs.window_done(discarded=epoch_loop._elan_discarded, closed=not open_window)

    epoch_loop.advance = advance
    epoch_loop._elan_recover = recover


def redo_end_hooks_cut_by_a_death(
    trainer: pl.Trainer, recover: Callable[[BaseException, Callable[[], None] | None], bool]
) -> None:
    """A member's death inside an ``on_train_batch_end`` hook (a callback's collective: ``ModelCheckpoint``'s save
    barrier and broadcasts, a user callback's ``all_gather``) comes after the batch's step was committed: the job
    recovers and that hook runs again in the new generation; the hooks after it then run as usual.

    ``_TrainingEpochLoop.advance`` calls ``call._call_callback_hooks(trainer, "on_train_batch_end", ...)`` (each
    callback's hook looked up with ``getattr`` at call time) and then the LightningModule's hook the same way, so an
    instance attribute of that name replaces the method for this trainer's objects only. An error that is not a
    member's death is re-raised by ``recover``.

    The same holds at an epoch's end, after its last step: ``_FitLoop.on_advance_end`` calls the callbacks' and the
    LightningModule's ``on_train_epoch_end`` (``ModelCheckpoint`` saves there by default, a user's hook may
    ``all_gather``), then ``trainer._logger_connector.on_epoch_end()`` and ``update_train_epoch_metrics()``, which
    sync the epoch's ``sync_dist`` aggregates (``on_epoch_end`` also ends evaluation epochs: only a training epoch's
    end is redone there). And at the training's end, after the job's last step: ``_FitLoop.on_run_end`` calls the
    callbacks' and the LightningModule's ``on_train_end`` (a rank 0 that writes a summary, a barrier before the
    others read it)."""
    for owner in [*trainer.callbacks, trainer.lightning_module]:
        _retry_after_recovery(owner, "on_train_batch_end", recover)
        _retry_after_recovery(owner, "on_train_epoch_end", recover)
        _retry_after_recovery(owner, "on_train_end", recover)
    for name in ("on_epoch_end", "update_train_epoch_metrics"):
        _retry_after_recovery(trainer._logger_connector, name, recover, when=lambda: trainer.training)


def follow_start_hooks(trainer: pl.Trainer, hooks: tuple[str, ...], entering: Callable[[str | None], None]) -> None:
    """Tell ``entering`` which of ``hooks`` runs: ``"on_train_start/2"`` (the hook and its owner's place among the
    trainer's callbacks, the LightningModule last) as one begins, again as it runs again after a recovery (the retry
    of :func:`redo_start_hooks_cut_by_a_death` wraps this one), and None as it returns.

    ``_Trainer._run`` calls ``call._call_callback_hooks(trainer, "on_fit_start")`` and then the LightningModule's hook,
    ``_FitLoop.on_run_start`` the same for ``on_train_start`` (each looked up with ``getattr`` at call time)."""
    for place, owner in enumerate([*trainer.callbacks, trainer.lightning_module]):
        for name in hooks:
            _follow(owner, name, f"{name}/{place}", entering)


def _follow(owner: Any, name: str, label: str, entering: Callable[[str | None], None]) -> None:
    hook = getattr(owner, name)
    if getattr(hook, "_elan_followed_by", None) == entering:
        return

    def followed(*args: Any, **kwargs: Any) -> Any:
        entering(label)
        try:
            return hook(*args, **kwargs)
        finally:
            entering(None)

    followed._elan_followed_by = entering  # type: ignore[attr-defined]
    setattr(owner, name, followed)


def redo_start_hooks_cut_by_a_death(
    trainer: pl.Trainer, recover: Callable[[BaseException, Callable[[], None] | None], bool]
) -> None:
    """A member's death inside an ``on_train_start`` or ``on_train_epoch_start`` hook, in a collective the strategy
    does not recover inside itself (a reduction: the statistics of the data, summed over the processes' shares, must
    be summed again over the survivors' new shares; ``torch.distributed`` called directly): the job recovers and that
    hook runs again in the new generation (the survivors' ranks and world size), the hooks after it as usual.

    ``_FitLoop.on_run_start`` calls ``call._call_callback_hooks(trainer, "on_train_start")`` and then the
    LightningModule's hook; ``_FitLoop.on_advance_start`` does the same with ``on_train_epoch_start`` (each looked up
    with ``getattr`` at call time, so an instance attribute replaces the method for this trainer's objects only)."""
    for owner in [*trainer.callbacks, trainer.lightning_module]:
        _retry_after_recovery(owner, "on_train_start", recover)
        _retry_after_recovery(owner, "on_train_epoch_start", recover)


def _retry_after_recovery(owner: Any, name: str, recover: Callable[[BaseException, Callable[[], None] | None], bool],
                          when: Callable[[], bool] = lambda: True) -> None:
    hook = getattr(owner, name)
    if getattr(hook, "_elan_retried_by", None) is recover:
        return

    def run_again_after_recovery(*args: Any, **kwargs: Any) -> Any:
        before, attributes = _deciding_state(owner), _users_attributes(owner)
        while True:
            try:
                return hook(*args, **kwargs)
            except Exception as error:
                if not when():
                    raise
                recover(error, None)
                if before is not None:
                    _give_back_deciding_state(owner, before, args[0])
                attributes.restore()
                log.warning("a member died during %s.%s: it runs again in the new generation",
                            type(owner).__name__, name)

    run_again_after_recovery._elan_retried_by = recover  # type: ignore[attr-defined]
    setattr(owner, name, run_again_after_recovery)


def _deciding_state(owner: Any) -> dict[str, Any] | None:
    """What Lightning's deciding callbacks keep, taken before a hook that may be cut by a death: ``ModelCheckpoint``
    drops the k-th best file from its top k and records the new one before its save's barrier, and removes the dropped
    file only after it, so a hook run again on that state dropped another file and left the first on disk (three files
    kept for ``save_top_k=2``); ``EarlyStopping`` counts a check once. None for other owners."""
    return callback_state(owner) if isinstance(owner, ModelCheckpoint | EarlyStopping) else None


def callback_state(callback: Any) -> dict[str, Any]:
    """A callback's ``state_dict`` (a copy) and, for a ``ModelCheckpoint``, its record of its saves
    (:data:`_CHECKPOINT_SAVE_RECORD`): a hook that saved the top-k checkpoint and met the death in the save of
    ``last.ckpt`` had set ``_last_global_step_saved``, and run again on that record it skipped both saves (the step's
    top-k checkpoint, rolled back with the ``state_dict``, was never written again: random kills,
    ``datamodule_callbacks.py`` seed 5400)."""
    saves = {name: getattr(callback, name) for name in _CHECKPOINT_SAVE_RECORD if hasattr(callback, name)}
    return {"state_dict": copy.deepcopy(callback.state_dict()),
            "saves": saves if isinstance(callback, ModelCheckpoint) else {}}


def _give_back_deciding_state(callback: Any, before: dict[str, Any], trainer: pl.Trainer) -> None:
    """Put back what a callback kept before a hook a death cut short (:func:`callback_state`). A checkpoint that
    ``ModelCheckpoint`` recorded in the interrupted run (a file rank 0 wrote before the others met the death in the
    save's barrier) is removed first (``Strategy.remove_checkpoint``: rank 0, a missing file is no error): run again,
    the hook writes it anew under the same name, where an existing file would make it take a ``-v1`` name."""
    if isinstance(callback, ModelCheckpoint):
        for path in _checkpoint_paths(callback.state_dict()) - _checkpoint_paths(before["state_dict"]):
            trainer.strategy.remove_checkpoint(path)
    callback.load_state_dict(copy.deepcopy(before["state_dict"]))
    for name, value in before["saves"].items():
        setattr(callback, name, value)


def _checkpoint_paths(state: dict[str, Any]) -> set[str]:
    """The checkpoint files a ``ModelCheckpoint.state_dict()`` names."""
    paths = {*state.get("best_k_models", {}), state.get("best_model_path"), state.get("kth_best_model_path"),
             state.get("last_model_path")}
    return {str(path) for path in paths if path}


def redo_validation_cut_by_a_death(
    trainer: pl.Trainer, recover: Callable[[BaseException, Callable[[], None] | None], bool]
) -> None:
    """A member's death during a validation run of the training loop: the survivors abandon that run, recover, and
    run it again from its start in the new generation (its loaders resharded over them: ``after_resize``), so it
    validates the whole set once, as a static run of their size would.

    ``_TrainingEpochLoop.on_advance_end`` sets ``trainer.validating``, calls ``val_loop.run()`` and then goes on with
    the batch's end (plateau schedulers, ``_batches_that_stepped``, logger saving): with the run redone in place, that
    rest runs once, as Lightning's. ``_EvaluationLoop.run`` is looked up on the loop at call time, so an instance
    attribute replaces it for this trainer only. The sanity check runs the same loop before the training loop, where a
    death is recovered inside each of the strategy's collectives (``elastic/pre_loop.py``); one seen in a collective
    made without the strategy (torchmetrics' sync) runs the sanity check again (:func:`_redo_sanity_check`).
    What is logged during the run (``log_eval_end_metrics``, step metrics) is held until it returns: a death after
    that (in ``on_validation_end``: ``ModelCheckpoint``'s save) logs the validation once too.
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if getattr(val_loop, "_elan_recover", None) == recover:  # a bound method: equal, not the same object
        return
    run = type(val_loop).run  # wrapped in Lightning's ``_no_grad_context``
    logs = _WindowLogs(trainer)

    def run_again_after_recovery() -> Any:
        while True:
            start = _validation_start(trainer)
            logs.holding = not trainer.sanity_checking
            try:
                outputs = run(val_loop)
            except Exception as error:
                logs.window_done(discarded=True, closed=True)
                if trainer.sanity_checking:
                    _redo_sanity_check(trainer, start, error, recover)
                    continue
                _abandon_validation(trainer, start)
                if recover(error, getattr(trainer.fit_loop.epoch_loop, "_elan_rewind_open_window", None)):
                    _redo_open_window(trainer)
                trainer.validating = True  # as ``on_advance_end`` set it before the run
                log.warning("a member died during validation: it runs again from its first batch in the new "
                            "generation (its hooks run again; the lists and dicts of your LightningModule and "
                            "callbacks are as they were when it began)")
                continue
            logs.window_done(discarded=False, closed=True)
            return outputs

    val_loop.run = run_again_after_recovery
    val_loop._elan_recover = recover


def _redo_sanity_check(trainer: pl.Trainer, start: dict[str, Any], error: BaseException,
                       recover: Callable[[BaseException, Callable[[], None] | None], bool]) -> None:
    """A member's death during the sanity check, seen in a collective the strategy does not make (torchmetrics'
    ``Metric.sync`` calls ``torch.distributed.all_gather`` itself, from a ``MetricCollection.compute()`` in
    ``on_validation_epoch_end``, say; the strategy's own reductions recover inside themselves: ``elastic/pre_loop.py``):
    the survivors recover (``recover`` re-raises what is not a death) and run the sanity check again from its first
    batch in the new generation. ``Trainer._run_sanity_check`` set ``sanity_checking`` before ``val_loop.run()`` and
    resets the results after it: the run redone in place leaves it as Lightning's."""
    _abandon_validation(trainer, start)
    recover(error, None)
    trainer.sanity_checking = True  # ``_abandon_validation`` set ``training`` as between two batches
    log.warning("a member died during the sanity check: it runs again from its first batch in the new generation")


class _WindowRedone(Exception):
    """Raised out of a validation run cut by a death inside an accumulation window: the window is redone."""


def _redo_open_window(trainer: pl.Trainer) -> None:
    """A validation run due in the middle of an accumulation window (``val_check_interval`` counts batches, not
    optimizer steps) was cut by a death: the window's step was not committed, so the job redoes it from its first
    batch (the elastic data position went back there, the gradients accumulated so far were dropped and the loop's
    progress rewound by ``recover``). The batches before the validation train again and the validation comes again
    after them: the rest of this batch's ``on_advance_end`` is skipped, as for a batch discarded in ``advance``, and
    the window's held logger rows are dropped."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop._elan_rewind_open_window = None
    epoch_loop._elan_window_logs.window_done(discarded=True, closed=True)
    trainer.training = True  # as ``on_advance_end`` sets it after the run
    log.warning("a member died during a validation inside an accumulation window: the window's step is redone from "
                "its first batch, and the validation after it")
    raise _WindowRedone


_VALIDATION_HOOKS = ("on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                     "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end")
"""The callback hooks a validation run of the training loop calls (``_EvaluationLoop.run``)."""


def _validation_start(trainer: pl.Trainer, loop: Any = None) -> dict[str, Any]:
    """What a validation run changes and an abandoned run must give back: the loop's ``batch_progress`` (``reset``
    keeps its totals), the logged results (``val_loop._results``: a ``_ResultMetric`` per key, wrapping the
    torchmetrics ``Metric`` logged as such) and the LightningModule's torchmetrics (updated by ``validation_step``),
    each submodule's ``training`` flag (``on_run_start``'s ``_on_evaluation_model_eval``), the logger connector's
    ``_first_loop_iter`` (which ``on_advance_end`` saves around the run) and the metrics it hands on; the state of the
    callbacks with validation hooks (``EarlyStopping``'s ``wait_count`` and ``best_score``, ``ModelCheckpoint``'s top k,
    through their ``state_dict``, what a checkpoint keeps of them) and ``trainer.should_stop``: a death in
    ``on_validation_end`` (in ``ModelCheckpoint``'s save barrier, after ``EarlyStopping`` counted the run) made the redo
    count the run twice, and the job stopped early. ``loop``: another evaluation loop than the fit's validation
    (``trainer.validate_loop``, ``test_loop``, ``predict_loop``, which has no logged results)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop if loop is None else loop
    connector = trainer._logger_connector
    _track_weight_swaps(trainer)
    return {
        "callbacks": [(callback, callback_state(callback)) for callback in trainer.callbacks
                      if any(is_overridden(hook, callback, parent=Callback) for hook in _VALIDATION_HOOKS)],
        "attributes": kept_user_attributes(trainer),
        "should_stop": trainer.should_stop,
        "progress": val_loop.batch_progress.state_dict(),
        "metrics": _metric_states(trainer, getattr(val_loop, "_results", None) or {}),
        "modes": {module: module.training for module in trainer.lightning_module.modules()},
        "first_loop_iter": connector._first_loop_iter,
        "connector": {name: dict(getattr(connector, name))
                      for name in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")},
    }


def _abandon_validation(trainer: pl.Trainer, start: dict[str, Any], loop: Any = None) -> None:
    """Give back what the interrupted validation run changed (:func:`_validation_start`), stop its loader's iterator
    (``_DataFetcher.teardown`` resets the ``CombinedLoader``, shutting its workers down) and make its loaders be
    requested again at the next run (:func:`reset_evaluation_dataloaders`). ``trainer.training`` is set as between
    two batches while the job recovers (``on_advance_end`` resets it only after ``val_loop.run()`` returns); another
    ``loop`` (:func:`_validation_start`) keeps the trainer's stage, and requests its loaders at every run."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop if loop is None else loop
    connector = trainer._logger_connector
    if val_loop._data_fetcher is not None:
        val_loop._data_fetcher.teardown()
        val_loop._data_fetcher = None
    val_loop._combined_loader = None
    val_loop.batch_progress.load_state_dict(start["progress"])
    _restore_metric_states(getattr(val_loop, "_results", None) or {}, start["metrics"])
    for module, training in start["modes"].items():
        module.training = training
    connector._first_loop_iter, connector._current_fx = start["first_loop_iter"], None
    for name, metrics in start["connector"].items():
        setattr(connector, name, metrics)
    for callback, state in start["callbacks"]:
        _give_back_deciding_state(callback, state, trainer)
    start["attributes"].restore()
    _swap_back_averaged_weights(trainer)
    trainer.should_stop = start["should_stop"]
    if loop is None:
        trainer.training = True


def _weight_averaging_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging`` …; Lightning 2.6 and later)."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # Lightning before 2.6
        return []
    return [callback for callback in trainer.callbacks if isinstance(callback, WeightAveraging)]


def _track_weight_swaps(trainer: pl.Trainer) -> None:
    """Note on each ``WeightAveraging`` callback whether its validation hooks hold the weights swapped.

    ``callbacks/weight_averaging.py``: ``on_validation_epoch_start`` swaps the model's parameters and buffers with its
    ``AveragedModel``'s (``_swap_models``, values copied in place) and ``on_validation_epoch_end`` swaps them back. A
    run abandoned between the two (a member's death) must swap back before it runs again, or its second
    ``on_validation_epoch_start`` swaps the average out again and training goes on from the average
    (:func:`_swap_back_averaged_weights`). Lightning calls a callback's hooks by ``getattr`` on the instance
    (``call._call_callback_hooks``), so instance attributes wrap them for this trainer's callbacks only."""
    for callback in _weight_averaging_callbacks(trainer):
        if getattr(callback, "_elan_swaps_tracked", False):
            continue
        callback._elan_swapped = False
        callback._elan_swaps_tracked = True
        start, end = callback.on_validation_epoch_start, callback.on_validation_epoch_end

        def swapped_in(trainer: pl.Trainer, pl_module: pl.LightningModule, _callback: Any = callback,
                       _start: Callable[..., None] = start) -> None:
            _start(trainer, pl_module)
            _callback._elan_swapped = _callback._average_model is not None

        def swapped_out(trainer: pl.Trainer, pl_module: pl.LightningModule, _callback: Any = callback,
                        _end: Callable[..., None] = end) -> None:
            _end(trainer, pl_module)
            _callback._elan_swapped = False

        callback.on_validation_epoch_start, callback.on_validation_epoch_end = swapped_in, swapped_out


def _swap_back_averaged_weights(trainer: pl.Trainer) -> None:
    """An abandoned validation run left a ``WeightAveraging`` callback's average in the model: swap it back
    (:func:`_track_weight_swaps`)."""
    for callback in _weight_averaging_callbacks(trainer):
        if getattr(callback, "_elan_swapped", False):
            callback._swap_models(trainer.lightning_module)
            callback._elan_swapped = False


def redo_evaluations_cut_by_a_death(trainer: pl.Trainer, recover: Callable[[BaseException], None],
                                    pass_done: Callable[[], None]) -> None:
    """A member's death during ``trainer.validate``, ``trainer.test`` or ``trainer.predict`` (after ``fit``, or
    without one): the survivors abandon the pass, recover (``recover`` re-raises what is not a member's death) and run
    it again from its first batch among themselves, its loaders sharded over them, so each sample is evaluated once, as
    a static run of their size would (exact where the dataset divides among both worlds: ``DistributedSampler`` pads).

    ``Trainer._run_stage`` calls ``self._evaluation_loop.run()`` (``validate_loop``, ``test_loop``) or
    ``self.predict_loop.run()``, looked up on the loop at call time: an instance attribute replaces it for this
    trainer only. Outside ``fit`` these loops request their loaders at every run (``_EvaluationLoop.setup_data`` returns
    early only while fitting; ``_PredictionLoop.setup_data`` always requests them), so the run again reshards them; the
    prediction loop's ``reset`` clears its predictions. A prediction makes no collective, and a validation without
    ``sync_dist`` none either: ``pass_done()`` (every member finished the pass, or none did: it raises once a member
    died) runs after each run, inside the retry. What the run logs is held until then, so a pass run again logs
    once."""
    logs = getattr(trainer, "_elan_evaluation_logs", None)
    if logs is None:
        logs = trainer._elan_evaluation_logs = _WindowLogs(trainer)
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        if getattr(loop, "_elan_recover", None) != recover:  # a bound method: equal, not the same object
            _redo_evaluation_pass(trainer, loop, logs, recover, pass_done)


def ends_a_checkpoint_save(*args: Any, **kwargs: Any) -> bool:
    """Whether a strategy ``barrier(*args, **kwargs)`` is the one ``Trainer.save_checkpoint`` ends with
    (``self.strategy.barrier("Trainer.save_checkpoint")``, lightning/pytorch/trainer/trainer.py): rank 0 may have died
    before it wrote the file, so a death there runs the hook that saved again (:func:`redo_end_hooks_cut_by_a_death`)
    rather than only the barrier."""
    name = args[0] if args else kwargs.get("name")
    return name == "Trainer.save_checkpoint"


def inside_a_call(trainer: pl.Trainer) -> bool:
    """Whether ``trainer`` runs ``fit``/``validate``/``test``/``predict`` now (``TrainerState.status``: ``RUNNING``
    from the call's start to its end, ``FINISHED`` after it)."""
    return trainer.state.status == TrainerStatus.RUNNING


def redo_saves_cut_by_a_death(trainer: pl.Trainer, recover: Callable[[BaseException], None]) -> None:
    """``trainer.save_checkpoint(path)`` called between the trainer's calls (``fit`` then a final save, the commonest
    script there is): the survivors of a member's death in it recover (``recover`` re-raises what is not a member's
    death) and save again among themselves.

    ``Trainer.save_checkpoint`` (lightning/pytorch/trainer/trainer.py) makes collectives: ``dump_checkpoint`` asks the
    strategy for the model's and optimizers' states (a sharded strategy gathers them), the strategy writes (every
    member, for sharded checkpoints) and it ends in ``strategy.barrier("Trainer.save_checkpoint")``. An instance
    attribute replaces the method for this trainer only. Inside a call (``trainer.state.status`` is ``RUNNING``: a
    callback's save during ``fit``) an error goes on as before: the hook that saved is run again by that call's own
    recovery."""
    if getattr(trainer, "_elan_redo_saves", None) == recover:  # a bound method: equal, not the same object
        return
    save = type(trainer).save_checkpoint

    def save_again_after_recovery(*args: Any, **kwargs: Any) -> None:
        while True:
            try:
                return save(trainer, *args, **kwargs)
            except Exception as error:
                if inside_a_call(trainer):
                    raise
                recover(error)
                log.warning("a member died during trainer.save_checkpoint: the survivors save the checkpoint again")

    trainer.save_checkpoint = save_again_after_recovery
    trainer._elan_redo_saves = recover


def _redo_evaluation_pass(trainer: pl.Trainer, loop: Any, logs: _WindowLogs, recover: Callable[[BaseException], None],
                          pass_done: Callable[[], None]) -> None:
    run = type(loop).run  # wrapped in Lightning's ``_no_grad_context``

    def run_again_after_recovery() -> Any:
        while True:
            start = _validation_start(trainer, loop)
            logs.holding = loop._elan_in_pass = True
            try:
                outputs = run(loop)
                pass_done()
            except Exception as error:
                loop._elan_in_pass = False
                logs.window_done(discarded=True, closed=True)
                _abandon_validation(trainer, start, loop)
                recover(error)
                log.warning("a member died during trainer.%s: the survivors run it again from its first batch",
                            trainer.state.fn.value if trainer.state.fn is not None else "evaluation")
                continue
            loop._elan_in_pass = False
            logs.window_done(discarded=False, closed=True)
            return outputs

    loop.run = run_again_after_recovery
    loop._elan_recover = recover


def evaluation_pass_running(trainer: pl.Trainer) -> bool:
    """A pass of ``trainer.validate/test/predict`` is running (:func:`redo_evaluations_cut_by_a_death`): a death in it
    runs the whole pass again, not the collective that met it."""
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    return any(getattr(loop, "_elan_in_pass", False) for loop in loops)


def _rewind_window(trainer: pl.Trainer, data_fetcher: Any, saved: dict[str, Any]) -> None:
    """Back to where the interrupted step's first batch began: progress counters, fetcher, metric states."""
    _restore_progress(trainer.fit_loop.epoch_loop, data_fetcher, saved)
    _restore_metric_states(trainer.fit_loop.epoch_loop._results, saved["metrics"])
    _restore_buffers(saved["buffers"])
    saved["attributes"].restore()


_Row = tuple[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]]
"""A row held for the loggers: the logger, its own ``log_metrics``, the call's arguments."""


class _WindowLogs:
    """Holds what the training batches of an open step send to the loggers (``Logger.log_metrics``:
    ``LearningRateMonitor`` logs in ``on_train_batch_start``, the logger connector the step's metrics at the end of
    ``_TrainingEpochLoop.advance``) until the step stands: a step discarded by a member's death and redone logs once.
    What is logged between batches (validation, the epoch's end, ``LearningRateMonitor`` at an epoch's start) goes
    straight through and is saved at once: a callback logs without the logger connector's ``save``, and rank 0 killed
    in the next batch took the row in its ``CSVLogger``'s buffer with it. Each logger's ``log_metrics`` is replaced by
    an instance attribute, for this trainer's loggers only.

    ``_LoggerConnector.log_metrics`` calls each logger's ``save`` right after its ``log_metrics`` (``CSVLogger``
    writes its buffered rows to ``metrics.csv`` there): that save came while the rows were held, so the loggers that
    get held rows save once they have them. Else those rows would stay in rank 0's memory until its next log, and
    rank 0's death before that (the next window's first micro-batch logs nothing) would lose them.

    Every process keeps the rows of its last closed window (numbered by ``window()``, the same on every member) and
    tells ``closed`` once it sent and saved them; only rank 0's loggers write (``rank_zero_only``), so a new rank 0
    whose predecessor died before it wrote them :meth:`resend` s them (``elastic/logged_rows.py``)."""

    def __init__(self, trainer: pl.Trainer, window: Callable[[], int] | None = None) -> None:
        self.holding = False
        self.closed: Callable[[int], None] | None = None
        self._window = window
        self._held: list[_Row] = []
        self._last: tuple[int, list[_Row]] | None = None  # the last closed window with rows
        for logger in trainer.loggers:
            self._hold(logger)

    def _hold(self, logger: Any) -> None:
        send = logger.log_metrics

        def log_metrics(*args: Any, **kwargs: Any) -> None:
            if not self.holding:
                send(*args, **kwargs)
                logger.save()  # a callback's row between batches (LearningRateMonitor's at an epoch's start)
                return None
            self._held.append((logger, send, args, kwargs))
            return None

        logger.log_metrics = log_metrics

    def window_done(self, discarded: bool, closed: bool) -> None:
        """After a batch: a discarded step's logs are dropped, a closed step's sent (and saved)."""
        self.holding = False
        if discarded:
            self._held.clear()
        elif closed:
            held, self._held = self._held, []
            self._send(held)
            if held and self._window is not None:
                self._last = (self._window(), held)
                if self.closed is not None:
                    self.closed(self._last[0])

    def resend(self, window: int) -> bool:
        """Send (and save) the rows of closed ``window`` again; False when they are not the last this process kept."""
        if self._last is None or self._last[0] != window:
            log.debug("no logger rows of window %d kept here", window)
            return False
        self._send(self._last[1])
        return True

    @staticmethod
    def _send(held: list[_Row]) -> None:
        for _, send, args, kwargs in held:
            send(*args, **kwargs)
        for logger in {id(logger): logger for logger, *_ in held}.values():
            logger.save()


def keep_logged_rows(trainer: pl.Trainer, closed: Callable[[int], None]) -> Callable[[int], bool]:
    """Call ``closed(window)`` after every closed training step whose rows went to the loggers (see
    :func:`redo_interrupted_batches`); returns what sends a closed window's rows again."""
    logs: _WindowLogs = trainer.fit_loop.epoch_loop._elan_window_logs
    logs.closed = closed
    return logs.resend


_FRAMEWORK_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_elan.")
_LAZY_FRAMEWORK_ATTRIBUTES = frozenset({"_hparams", "_hparams_initial", "_hparams_name"})
"""What ``LightningModule.save_hyperparameters`` adds after ``__init__`` (``core/mixins/hparams_mixin.py``)."""


def kept_user_attributes(trainer: pl.Trainer) -> KeptAttributes:
    """The lists, dicts, sets, deques, numbers, strings and small tensors the user's LightningModule and own callbacks
    keep as attributes (``kept_attributes.py``), as they are now: put back when the work that begins is redone after a
    death. An attribute is the user's when a bare instance of the framework class it derives from lacks it: Lightning
    (``core/module.py``, ``callbacks/callback.py``) and ``nn.Module`` create their own in ``__init__``, and
    ``save_hyperparameters`` its ``_hparams``. A callback is the user's when no class of its own but ``Callback`` is
    Lightning's (a subclass of ``ModelCheckpoint`` keeps Lightning's state, given back through its ``state_dict``)."""
    owners = [trainer.lightning_module, *(callback for callback in trainer.callbacks if _a_users_callback(callback))]
    return KeptAttributes(owners, _a_users_attribute)


def _users_attributes(owner: Any) -> KeptAttributes:
    """The attributes of a hook's owner that are the user's (:func:`kept_user_attributes`), as the hook begins: one
    that cleared the list of a step's outputs before the collective that met the death finds it full again."""
    users = isinstance(owner, LightningModule) or (isinstance(owner, Callback) and _a_users_callback(owner))
    return KeptAttributes([owner] if users else [], _a_users_attribute)


def _a_users_callback(callback: Callback) -> bool:
    return all(not cls.__module__.startswith(_FRAMEWORK_PACKAGES) or cls.__name__ == "Callback"
               for cls in type(callback).__mro__[:-1])


def _a_users_attribute(owner: object, name: str) -> bool:
    return (not name.startswith(("_elan", "__")) and name not in _LAZY_FRAMEWORK_ATTRIBUTES
            and name not in _framework_attributes(type(owner)))


@functools.cache
def _framework_attributes(cls: type) -> frozenset[str]:
    """The attributes a bare instance of ``cls``'s framework base (its LightningModule or Callback class) has."""
    for base in cls.__mro__:
        if base.__module__.startswith(_FRAMEWORK_PACKAGES) and base.__name__ in ("LightningModule", "Callback"):
            return frozenset(vars(base()))
    return frozenset()


def _buffer_states(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]:
    """The module's buffers as the step's first batch began (each submodule, its buffer's name, the tensor and a
    copy): a forward or a ``training_step`` updates some (BatchNorm's running statistics and ``num_batches_tracked``
    in place, a user's EMA kept with ``register_buffer`` in place or by assigning a new tensor), and a step discarded by
    a member's death must not count twice. torchmetrics states are not buffers (``_metric_states``)."""
    return [(owner, name, buffer, buffer.detach().clone())
            for owner in module.modules() for name, buffer in owner.named_buffers(recurse=False)]


def _restore_buffers(saved: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    """The saved values go back into the saved tensors, which become the buffers again (DDP keeps references to the
    module's buffers: an attempt that assigned a new tensor is undone too)."""
    with torch.no_grad():
        for owner, name, buffer, value in saved:
            if buffer.shape == value.shape:
                buffer.copy_(value)
            else:  # resized in place by the discarded attempt
                buffer.set_(value)
            setattr(owner, name, buffer)  # Module.__setattr__ of a registered buffer's name: the buffer again


def _metric_states(trainer: pl.Trainer, results: Any) -> dict[str, Any]:
    """What a training step (or a validation run) accumulates: the logged values of ``self.log(on_epoch=True)`` (its
    loop's ``_ResultCollection``: key -> ``_ResultMetric``) and the LightningModule's torchmetrics."""
    metrics = [m for m in trainer.lightning_module.modules() if isinstance(m, Metric)] + list(results.values())
    return {"keys": set(results), "states": [(metric, _metric_state(metric)) for metric in metrics]}


def _metric_state(metric: Metric) -> dict[str, Any]:
    """torchmetrics 1.x ``Metric``: its states are the ``_defaults`` attributes (updated in place by many a user's
    ``update``: copied), plus ``_update_count``, the cached ``_computed`` and ``_forward_cache``; Lightning's
    ``_ResultMetric`` adds ``has_reset``."""
    return {"states": {name: _copied(getattr(metric, name)) for name in metric._defaults},
            "update_count": metric._update_count, "computed": metric._computed,
            "forward_cache": metric._forward_cache, "has_reset": getattr(metric, "has_reset", None)}


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return list(value) if isinstance(value, list) else value


def _restore_metric_states(results: Any, saved: dict[str, Any]) -> None:
    for key in set(results) - saved["keys"]:  # first logged by the discarded attempt
        del results[key]
    for metric, state in saved["states"]:
        for name, value in state["states"].items():
            setattr(metric, name, _copied(value))
        metric._update_count, metric._computed = state["update_count"], state["computed"]
        metric._forward_cache = state["forward_cache"]
        if state["has_reset"] is not None:
            metric.has_reset = state["has_reset"]


def around_dataloader_requests(trainer: pl.Trainer, around: Callable[[str, Callable[[], Any]], Any]) -> None:
    """Run each request of the training and validation loaders of ``fit`` as ``around(hook_name, request)``.

    ``_FitLoop.setup_data`` and ``_EvaluationLoop.setup_data`` call ``_request_dataloader(self._data_source)``, which
    calls the ``_DataLoaderSource``'s ``dataloader()`` (the LightningModule's or DataModule's ``*_dataloader`` hook,
    or the loader given to ``fit``); the sources live as long as the loops, so an instance attribute replaces the method
    for this trainer only (``trainer.estimated_stepping_batches`` requests the training loader the same way)."""
    for source in (trainer.fit_loop._data_source, trainer.fit_loop.epoch_loop.val_loop._data_source):
        if getattr(source, "_elan_around", None) is around:
            continue
        request = type(source).dataloader.__get__(source)
        source.dataloader = lambda request=request, name=source.name: around(name, request)
        source._elan_around = around


def no_checkpoint_selected_after_leaving(trainer: pl.Trainer, left: Callable[[], bool]) -> None:
    """A ``trainer.validate/test/predict/fit(ckpt_path=...)`` on a worker that ``left()`` the job selects no checkpoint.

    Lightning's ``_validate_impl``/``_test_impl``/``_predict_impl``/``_fit_impl`` call
    ``trainer._checkpoint_connector._select_ckpt_path`` before ``_run`` (so before the strategy's ``setup``, which
    skips the stage on a leaver): ``ckpt_path="best"`` raises ``ValueError`` where the leaver's ``ModelCheckpoint``
    has no best model yet (it left before the first one was saved), and a path is loaded for nothing. The connector
    lives as long as the trainer, so an instance attribute replaces the method for this trainer only."""
    connector = trainer._checkpoint_connector
    wrapped = hasattr(connector, "_elan_left")
    connector._elan_left = left  # the latest fit's
    if wrapped:
        return
    select = type(connector)._select_ckpt_path.__get__(connector)

    def select_unless_left(*args: Any, **kwargs: Any) -> Any:
        return None if connector._elan_left() else select(*args, **kwargs)

    connector._select_ckpt_path = select_unless_left


def prepare_data_as_the_job(trainer: pl.Trainer, left: Callable[[], bool],
                            in_turn: Callable[[], AbstractContextManager[Any]]) -> None:
    """``prepare_data`` of a worker of an elastic job: none on a worker that ``left()`` it, and the user's hooks one
    process of the host at a time (``in_turn()``: a context held while one runs).

    Lightning's ``Trainer._run`` calls ``trainer._data_connector.prepare_data()`` after the strategy's
    ``setup_environment`` and before its ``setup`` (which skips the stage on a leaver); ``_DataConnector.prepare_data``
    wraps an overridden ``prepare_data`` of the datamodule or the LightningModule in ``_InfiniteBarrier``, which makes a
    gloo group with ``torch.distributed.new_group``: a leaver is in no generation, and that raised (a traceback and
    exit 1 of a leaver whose script runs ``trainer.test(datamodule=...)`` after ``fit``). A leaver evaluates and trains
    nothing, so it needs no data. Inside the barrier the connector calls each hook by ``getattr`` on the instance
    (``call._call_lightning_datamodule_hook`` / ``_call_lightning_module_hook``) on the local rank 0 only, so an
    instance attribute wrapping an overridden hook runs that hook in turn without holding up the barrier's other ranks
    (a joiner on a member's host is its own local rank 0: the two ran the hook at once). The connector lives as long as
    the trainer, so an instance attribute replaces its method for this trainer only."""
    connector = trainer._data_connector
    wrapped = hasattr(connector, "_elan_left")
    connector._elan_left, connector._elan_in_turn = left, in_turn
    if wrapped:
        return
    prepare = type(connector).prepare_data.__get__(connector)

    def prepare_as_the_job() -> None:
        if connector._elan_left():
            return
        holders = [holder for holder in (trainer.datamodule, trainer.lightning_module)
                   if holder is not None and is_overridden("prepare_data", holder)]
        for holder in holders:
            holder.prepare_data = _in_turn(holder.prepare_data, connector._elan_in_turn)
        try:
            prepare()
        finally:
            for holder in holders:
                del holder.prepare_data

    connector.prepare_data = prepare_as_the_job


def _in_turn(hook: Callable[[], Any], in_turn: Callable[[], AbstractContextManager[Any]]) -> Callable[[], Any]:
    @functools.wraps(hook)  # ``__wrapped__``: Lightning's ``is_overridden`` still sees the user's hook
    def run_in_turn() -> Any:
        with in_turn():
            return hook()

    return run_in_turn


def epoch_aggregates(trainer: pl.Trainer) -> dict[str, Any]:
    """What this process accumulated in the training epoch for values reduced over the processes at its end (keys
    alike on every process): ``self.log(..., on_epoch=True, sync_dist=True)`` values — the training epoch loop's
    ``_ResultCollection`` maps a key to a ``_ResultMetric`` whose states are ``value`` (a sum, or the maximum/minimum)
    and, for a mean, ``cumulated_batch_size``; ``compute`` syncs both — and the LightningModule's torchmetrics that
    sync on ``compute``. A value logged without ``sync_dist`` is each process's own (rank 0's is logged): left out."""
    _absorb_pending(trainer, at_boundary=True)
    return {key: _states_of(metric) for key, metric in _aggregate_targets(trainer).items() if metric._update_count}


def absorb_epoch_aggregates(trainer: pl.Trainer, parts: list[dict[str, Any]]) -> None:
    """Add other processes' :func:`epoch_aggregates` to this process's own: the epoch's reduction then covers them.

    A value this process has not logged yet in the epoch (a joiner that took the aggregates of a whole migration, a
    value logged on some batches only) has no ``_ResultMetric`` to add to: ``_ResultCollection.log`` makes it, with its
    metadata, at the first ``self.log`` of that key. Such a part waits until then (:func:`epoch_aggregates`, at each
    batch boundary, adds it), within the epoch of the first boundary after it was taken — not ``current_epoch`` now: a
    joiner takes it in ``strategy.setup``, before Lightning restores its loops (``current_epoch`` is still 0 there)."""
    pending = _pending_aggregates(trainer)
    for part in parts:
        pending.extend((None, key, incoming) for key, incoming in part.items())
    _absorb_pending(trainer, at_boundary=False)


def _pending_aggregates(trainer: pl.Trainer) -> list[tuple[int | None, str, dict[str, Any]]]:
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_elan_pending_aggregates"):
        epoch_loop._elan_pending_aggregates = []
    return epoch_loop._elan_pending_aggregates


def _absorb_pending(trainer: pl.Trainer, at_boundary: bool) -> None:
    """Add the pending parts that have a counterpart now; at a batch boundary, bind the others to its epoch (they
    wait for a ``self.log`` of their key until that epoch ends)."""
    pending = _pending_aggregates(trainer)
    if not pending:
        return
    targets, waiting = _aggregate_targets(trainer), []
    for epoch, key, incoming in pending:
        metric = targets.get(key)
        if epoch is None and at_boundary:
            epoch = trainer.current_epoch
        if epoch is not None and epoch != trainer.current_epoch:
            log.warning("epoch aggregate %s of a departed member was never logged here in epoch %d: left out", key,
                        epoch)
        elif metric is None:
            waiting.append((epoch, key, incoming))
        elif isinstance(metric, _ResultMetric):
            _add_logged_value(metric, incoming)
        else:
            _add_metric_states(key, metric, incoming)
    pending[:] = waiting


def _aggregate_targets(trainer: pl.Trainer) -> dict[str, Metric]:
    targets: dict[str, Metric] = {
        f"logged/{key}": result for key, result in trainer.fit_loop.epoch_loop._results.items()
        if result.is_tensor and result.meta.on_epoch and result.meta.sync.should and not result.meta.sync.rank_zero_only
    }
    for name, module in trainer.lightning_module.named_modules():
        if isinstance(module, Metric) and module.sync_on_compute:
            targets[f"metric/{name}"] = module
    return targets


def _states_of(metric: Metric) -> dict[str, Any]:
    states = {name: _on_cpu(getattr(metric, name)) for name in metric._defaults}
    return {"states": states, "update_count": int(metric._update_count)}


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return [_on_cpu(item) if isinstance(item, torch.Tensor) else item for item in value]


def _add_logged_value(result: _ResultMetric, incoming: dict[str, Any]) -> None:
    """``_ResultMetric.update``'s own accumulation, with another process's totals as the update."""
    value = incoming["states"]["value"].to(result.value.device, result.value.dtype)
    meta = result.meta
    if meta.is_max_reduction or meta.is_min_reduction:
        result.value = meta.reduce_fx(result.value, value)
    else:
        result.value = result.value + value
    if meta.is_mean_reduction:
        result.cumulated_batch_size = result.cumulated_batch_size + incoming["states"]["cumulated_batch_size"].to(
            result.cumulated_batch_size.device)
    _counted(result, incoming)


def _add_metric_states(key: str, metric: Metric, incoming: dict[str, Any]) -> None:
    """torchmetrics' ``Metric._reduce_states`` (what ``merge_state`` runs): each state reduced with the other's by its
    ``dist_reduce_fx``. A state averaged over processes (``"mean"``) or gathered unreduced (None) cannot take another
    process's part exactly: such a metric is left as it is, with a warning."""
    from torchmetrics.utilities.data import dim_zero_mean

    if any(metric._reductions[name] in (None, dim_zero_mean) for name in metric._defaults):
        log.warning("epoch aggregate %s (%s) reduces a state by mean or not at all: a departed member's part is left "
                    "out", key, type(metric).__name__)
        return
    device = metric.device
    states = {name: (value.to(device) if isinstance(value, torch.Tensor) else [item.to(device) for item in value])
              for name, value in incoming["states"].items()}
    metric._reduce_states(states)
    _counted(metric, incoming)


def _counted(metric: Metric, incoming: dict[str, Any]) -> None:
    """The heir's count grows by the departed member's updates; a value it already computed is kept.

    ``Metric.compute`` (and ``_ResultMetric.compute``, the ``self.log`` value) caches its synced result in
    ``_computed`` until ``reset``, and Lightning's ``_ResultCollection._get_cache`` calls ``compute`` (a collective)
    only where that cache is empty. A value computed before the death was reduced over every member of the old
    generation, the departed one included: its part is in it already. Emptying the heir's cache alone made the heir
    alone reduce again when a hook cut by the death ran again (``ModelCheckpoint.on_train_epoch_end`` reads
    ``callback_metrics``), while the other survivors, their caches kept, went on to the save's barrier: each waited
    in a different collective forever. With the cache kept, every survivor makes the same collectives, and a value
    not computed yet is reduced once, over the survivors, the departed part in the heir's states."""
    metric._update_count += incoming["update_count"]


def _progress_state(epoch_loop: Any, data_fetcher: Any) -> dict[str, Any]:
    return {
        "batch": epoch_loop.batch_progress.state_dict(),
        "automatic": epoch_loop.automatic_optimization.optim_progress.state_dict(),
        "manual": epoch_loop.manual_optimization.optim_step_progress.state_dict(),
        "fetched": getattr(data_fetcher, "fetched", None),
    }


def _restore_progress(epoch_loop: Any, data_fetcher: Any, saved: dict[str, Any]) -> None:
    epoch_loop.batch_progress.load_state_dict(saved["batch"])
    epoch_loop.automatic_optimization.optim_progress.load_state_dict(saved["automatic"])
    epoch_loop.manual_optimization.optim_step_progress.load_state_dict(saved["manual"])
    if saved["fetched"] is not None:
        data_fetcher.fetched = saved["fetched"]
        data_fetcher.done = False


def train_dataloaders(trainer: pl.Trainer) -> list[Any]:
    """The processed training loaders held by ``_FitLoop._combined_loader``."""
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def refetch_prefetched_batch(trainer: pl.Trainer) -> None:
    """Replace the batch ``_PrefetchDataFetcher`` already fetched for the old world with one for the new world.

    The fetcher keeps batches ahead in ``batches`` only for a loader without a length (Lightning 2.6's
    ``_PrefetchDataFetcher.__iter__``; the elastic loader has one, so nothing is kept) and counts ``fetched`` to
    compute ``done``; ``_DataFetcher.__next__`` fetches one batch and counts it (2.6 has no ``_fetch_next_batch``).
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or not getattr(fetcher, "batches", None):
        return
    stale = len(fetcher.batches)
    fetcher.batches.clear()
    fetcher.fetched -= stale
    for _ in range(stale):
        try:
            fetcher.batches.append(_DataFetcher.__next__(fetcher))
        except StopIteration:
            fetcher.done = not fetcher.batches
            return


def undo_toggled_optimizer(module: pl.LightningModule) -> None:
    """Every parameter's ``requires_grad`` as before a ``toggle_optimizer`` a discarded step did not undo.

    ``LightningModule.toggle_optimizer`` keeps each parameter's flag before the toggle in ``_param_requires_grad_state``
    (parameter → flag) and sets the other optimizers' parameters to ``False``; ``untoggle_optimizer`` restores them and
    empties the dict (so an empty one: nothing is toggled).
    """
    state = getattr(module, "_param_requires_grad_state", None)
    if not state:
        return
    for parameter, requires_grad in state.items():
        parameter.requires_grad = requires_grad
    module._param_requires_grad_state = {}


def run_the_joined_epoch_as_the_members(trainer: pl.Trainer, accumulate_grad_batches: int) -> None:
    """A joiner's fit loop restarts mid-epoch from the source's state (``_Loop.load_state_dict`` sets it
    ``restarting``, until ``_FitLoop.on_iteration_done`` after that epoch). Where that makes the joined epoch start or
    end otherwise than the members', do what they do, once: later epochs run Lightning's own hooks.

    * Start: ``_FitLoop.on_advance_start`` skips the ``on_train_epoch_start`` hooks when it restarts mid-epoch (or
      at an epoch's end). What they set outside any saved state is set here then, before the epoch's first batch:

      - ``trainer.accumulate_grad_batches``, the members' (``GradientAccumulationScheduler`` sets it there, as a
        user's hook may): a joiner accumulating otherwise steps its optimizer at other batches, and the job hangs.
        Not earlier: ``GradientAccumulationScheduler.on_train_start`` refuses a value other than 1.
      - ``StochasticWeightAveraging`` builds its ``SWALR`` scheduler there and puts it in
        ``trainer.lr_scheduler_configs``; its ``state_dict`` holds the scheduler's state but not the scheduler, so
        without it the joiner would keep the optimizer's LR while the members anneal theirs. Its hook is idempotent
        for what the state holds (the scheduler state is loaded, the average updated once per epoch:
        ``_latest_update_epoch``), so it runs here as on the members.

      Other hooks are not replayed (a ``BackboneFinetuning`` would add its parameter group twice; a user's hook
      may log with ``sync_dist`` or run a collective the members do not run now).
    * End: ``_FitLoop.on_advance_end`` steps the ``ReduceLROnPlateau`` schedulers only when the loop is not
      ``restarting`` (Lightning's own resume skips them: a checkpoint holds no metric). The members' loop is not
      restarting there, and the joiner monitors their metrics (``set_callback_metrics``), so at that epoch's end the
      joiner's loop counts as not restarting either.
    """
    fit_loop = trainer.fit_loop
    loop_type = type(fit_loop)

    def start_as_the_members() -> None:
        del fit_loop.on_advance_start
        hooks_skipped = fit_loop.restarted_mid_epoch or fit_loop.restarted_on_epoch_end  # as on_advance_start tests
        loop_type.on_advance_start(fit_loop)
        if hooks_skipped:  # else the joiner joined before the loop, and the hooks ran as on the members
            trainer.accumulate_grad_batches = accumulate_grad_batches
            _start_swa_averaging(trainer)
            _warn_of_skipped_epoch_start_hooks(trainer)

    def end_as_the_members() -> None:
        del fit_loop.on_advance_end
        fit_loop._restarting = False
        loop_type.on_advance_end(fit_loop)

    fit_loop.on_advance_start = start_as_the_members
    fit_loop.on_advance_end = end_as_the_members


def _warn_of_skipped_epoch_start_hooks(trainer: pl.Trainer) -> None:
    """Say which of the user's ``on_train_epoch_start`` hooks did not run on this joiner, and what keeps their state."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    owners = [type(trainer.lightning_module).__name__] if is_overridden(
        "on_train_epoch_start", trainer.lightning_module) else []
    owners += [type(callback).__name__ for callback in trainer.callbacks
               if is_overridden("on_train_epoch_start", callback, Callback)
               and not type(callback).__module__.startswith(_LIGHTNING_PACKAGES)]
    if owners:
        log.warning(
            "this worker joined in the middle of epoch %d: like a resume from a mid-epoch checkpoint, it did not run "
            "the on_train_epoch_start of %s; what that hook sets must be kept in on_save_checkpoint/"
            "on_load_checkpoint (or state_dict/load_state_dict of a callback), or be derived from current_epoch, "
            "or this worker trains with other values than the members", trainer.current_epoch, ", ".join(owners))


_LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_elan.")


def _start_swa_averaging(trainer: pl.Trainer) -> None:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for callback in trainer.callbacks:
        if (isinstance(callback, StochasticWeightAveraging) and not callback._initialized
                and callback.swa_start <= trainer.current_epoch <= callback.swa_end):
            callback.on_train_epoch_start(trainer, trainer.lightning_module)


def callback_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """The values callbacks and plateau schedulers monitor (``trainer.callback_metrics``: the last ones logged)."""
    return dict(trainer.callback_metrics)


def set_callback_metrics(trainer: pl.Trainer, metrics: dict[str, Any]) -> None:
    """A joiner monitors what the members monitor: a validation it did not run included. ``_LoggerConnector``'s
    ``callback_metrics`` is its ``_callback_metrics`` dict, updated from the results of the hooks that log."""
    trainer._logger_connector._callback_metrics.update(metrics)


VALIDATION_LOADER_HOOK = "val_dataloader"
"""The name the validation loop of ``fit`` gives its ``_DataLoaderSource`` (``_EvaluationLoop.__init__``:
``f"{stage.dataloader_prefix}_dataloader"``)."""


def reset_evaluation_dataloaders(trainer: pl.Trainer) -> None:
    """Make the validation loop rebuild its loaders (and shards) at its next run: ``_EvaluationLoop.setup_data``
    returns early while ``_combined_loader`` is set."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop._combined_loader = None


def opens_optimizer_step(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether the training batch ``batch_idx`` is the first of its optimizer step: ``_AutomaticOptimization``
    zeroes the gradients at a ``batch_idx`` divisible by ``accumulate_grad_batches`` (1 with manual optimization)."""
    return batch_idx % trainer.accumulate_grad_batches == 0


def accumulating(trainer: pl.Trainer) -> bool:
    """After a training batch: its optimizer step is still open (``_TrainingEpochLoop._should_accumulate``)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def adjustment_blocker(trainer: pl.Trainer) -> str | None:
    """Why the job cannot change size after this batch, or None.

    Not while gradients accumulate (``_should_accumulate``), not on the epoch's last batch, and not when validation
    runs after this batch (``_should_check_val_fx``): a joiner restored from this state resumes as Lightning does after
    a checkpoint saved in ``on_train_batch_end`` and would skip that validation.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if accumulating(trainer):
        return "accumulating gradients"
    if epoch_loop.batch_progress.is_last_batch:
        return "last batch of the epoch"
    if trainer.fit_loop._data_fetcher is not None and epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
        return "validation due"
    if trainer.should_stop:
        return "training is stopping"
    return None


def logger_versions(trainer: pl.Trainer) -> list[Any]:
    """The version of each logger (``TensorBoardLogger``/``CSVLogger`` cache it in ``_version``)."""
    return [_cached_version(logger) for logger in trainer.loggers]


def resolved_logger_versions(trainer: pl.Trainer) -> list[Any]:
    """Each logger's version, resolved now where it names a directory: ``CSVLogger`` and ``TensorBoardLogger`` take
    the next free ``version_N`` of their directory at first use, which is rank 0's (it creates the directory when it
    first logs). Lightning resolves it on every rank for the first logger only (``Trainer.log_dir``,
    ``ModelCheckpoint``'s directory); other loggers keep ``_version`` None on the other ranks. Other loggers: their
    cached version, if it is a name or a number (``fast_dev_run``'s ``DummyLogger`` answers every attribute with a
    local function, which a broadcast cannot pickle)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    return [logger.version if isinstance(logger, CSVLogger | TensorBoardLogger) else _cached_version(logger)
            for logger in trainer.loggers]


def _cached_version(logger: Any) -> str | int | None:
    version = vars(logger).get("_version")
    return version if isinstance(version, str | int) else None


def set_logger_versions(trainer: pl.Trainer, versions: list[Any]) -> None:
    for logger, version in zip(trainer.loggers, versions, strict=False):
        if version is not None and (hasattr(type(logger), "_version") or "_version" in vars(logger)):
            logger._version = version


def align_checkpoint_dirs(trainer: pl.Trainer, callback_states: dict[str, Any]) -> None:
    """Give each ``ModelCheckpoint`` the source's ``dirpath`` before its state loads (its ``load_state_dict`` drops
    the best-k state when the directory differs; ``setup`` took the directory from a rank-0 broadcast)."""
    for callback in trainer.checkpoint_callbacks:
        state = callback_states.get(callback.state_key) if isinstance(callback, ModelCheckpoint) else None
        if state and state.get("dirpath"):
            callback.dirpath = state["dirpath"]


_CHECKPOINT_SAVE_RECORD = ("_last_global_step_saved", "_last_checkpoint_saved", "_defer_save_until_validation")
"""What ``ModelCheckpoint`` keeps of its own saves outside its ``state_dict`` (a restored one starts from 0): the step
it last saved at (``_save_checkpoint`` sets it; ``on_train_batch_end``, ``on_train_epoch_end`` and
``on_validation_end`` skip a save at that step through ``_should_skip_saving_checkpoint``), that file (``save_last=
"link"`` links to it) and whether a save waits for validation's metrics. ``_last_time_checked`` is not: it is this
process's ``time.monotonic()``, and ``train_time_interval``'s decision is rank 0's, broadcast."""


def checkpoint_saves(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """Each ``ModelCheckpoint``'s record of its saves (:data:`_CHECKPOINT_SAVE_RECORD`), by ``state_key``."""
    return {callback.state_key: {name: getattr(callback, name) for name in _CHECKPOINT_SAVE_RECORD
                                 if hasattr(callback, name)}
            for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)}


def set_checkpoint_saves(trainer: pl.Trainer, saves: dict[str, dict[str, Any]]) -> None:
    """A joiner's ``ModelCheckpoint``s take the members' record of their saves: with accumulated gradients the global
    step stays at the last save's for a window's micro-batches, and a joiner that did not know it saved there would
    save again alone, its save's barrier waiting while the members all-reduce."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            for name, value in saves.get(callback.state_key, {}).items():
                if hasattr(callback, name):
                    setattr(callback, name, value)


def move_progress_bar(trainer: pl.Trainer, loop_started: bool = True) -> None:
    """Show the progress bar on the (possibly new) global rank 0 only; ``ProgressBar.setup`` disabled it elsewhere.
    Before the training loop only the switch moves: ``TQDMProgressBar.on_train_start`` builds the bar."""
    for callback in trainer.callbacks:
        if not isinstance(callback, ProgressBar):
            continue
        if not trainer.is_global_zero:
            callback.disable()
        elif not loop_started:
            callback.enable()
        elif isinstance(callback, TQDMProgressBar) and callback._train_progress_bar is None:
            callback.enable()
            callback.train_progress_bar = callback.init_train_tqdm()
            callback.train_progress_bar.reset(total=trainer.num_training_batches)
            callback.train_progress_bar.initial = trainer.fit_loop.epoch_loop.batch_progress.current.ready


def move_profiler(trainer: pl.Trainer) -> None:
    """The profiler prints its report on local rank 0 only: ``Profiler._rank_zero_info`` tests the ``_local_rank``
    that ``Trainer.__setup_profiler`` gave it at the start (None in a one-process world). A member that became local
    rank 0 after a resize or a death (rank 0 killed) takes the old one's place: without it, no process printed the
    ``FIT Profiler Report``."""
    profiler = trainer.profiler
    if getattr(profiler, "_local_rank", None) is not None:
        profiler._local_rank = trainer.local_rank


def move_throughput_monitors(trainer: pl.Trainer, loop_started: bool = True) -> None:
    """``ThroughputMonitor`` after a resize: its ``Throughput``s count the new world (``setup`` gave them the world
    size of then), and a process that became global rank 0 in the training loop starts measuring there. Its hooks are
    ``rank_zero_only``: ``on_train_start`` called ``_start`` (the training stage's clock and counts) on the old rank 0
    only, so the new rank 0's first ``on_train_batch_end`` failed with ``KeyError: <RunningStage.TRAINING>``."""
    for callback in trainer.callbacks:
        if not isinstance(callback, ThroughputMonitor):
            continue
        for throughput in callback._throughputs.values():
            throughput.world_size = max(trainer.world_size, 1)
        stage = trainer.state.stage
        if loop_started and trainer.is_global_zero and stage == RunningStage.TRAINING and stage not in callback._t0s:
            callback._start(trainer)


def no_throughput_setup_after_leaving(trainer: pl.Trainer, left: Callable[[], bool]) -> None:
    """A ``trainer.validate/test/predict`` on a worker that ``left()`` the job skips ``ThroughputMonitor.setup``: it
    builds a ``Throughput`` with ``trainer.world_size``, 0 on a leaver (``assert world_size > 0`` failed before the
    strategy's ``setup`` skipped the stage). The leaver's evaluation runs no batch, so the monitor measures nothing."""
    for callback in trainer.callbacks:
        if not isinstance(callback, ThroughputMonitor) or hasattr(callback, "_elan_left"):
            continue
        setup = type(callback).setup.__get__(callback)

        def setup_unless_left(*args: Any, callback: Any = callback, setup: Any = setup, **kwargs: Any) -> None:
            if not callback._elan_left():
                setup(*args, **kwargs)

        callback.setup = setup_unless_left
        callback._elan_left = left


def adopt_loggers(trainer: pl.Trainer) -> None:
    """A worker that just became global rank 0 continues the loggers of the old rank 0.

    ``CSVLogger.experiment`` builds an ``_ExperimentWriter`` whose ``_check_log_dir_exists`` deletes an existing
    ``metrics.csv``; here the file holds the rows the old rank 0 wrote, so the writer is built without that check
    (its first ``save`` appends, re-writing the header when keys are new). TensorBoard just adds an event file.
    """
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter
    from lightning.pytorch.loggers import CSVLogger

    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger):
            continue
        if logger._experiment is None:
            check = _ExperimentWriter._check_log_dir_exists
            _ExperimentWriter._check_log_dir_exists = lambda self: None
            try:
                _ = logger.experiment
            finally:
                _ExperimentWriter._check_log_dir_exists = check
        if isinstance(logger._experiment, _ExperimentWriter):
            _adopt_csv_columns(logger._experiment)


def _adopt_csv_columns(writer: Any) -> None:
    """Start the adopted writer's ``metrics_keys`` from the columns of the file the old rank 0 wrote.

    ``_ExperimentWriter.save`` re-writes the file when a key is new to *this* writer, with ``metrics_keys`` as the
    header; rows of the old rank 0 holding a column this writer never logged (``train_loss_epoch`` after an epoch end)
    then fail ``csv.DictWriter`` with "dict contains fields not in fieldnames", and appended rows would not match the
    header's columns.
    """
    import csv

    if not writer._fs.isfile(writer.metrics_file_path):
        log.debug("no %s to continue", writer.metrics_file_path)
        return
    with writer._fs.open(writer.metrics_file_path, "r", newline="") as file:
        columns = next(csv.reader(file), [])
    writer.metrics_keys = sorted(set(writer.metrics_keys) | set(columns))


def refresh_epoch_length(trainer: pl.Trainer) -> int | float | None:
    """Re-read the training loaders' lengths into every place Lightning cached them; returns the new epoch length.

    After the global batch changes the epoch has a different number of batches (``len`` of the elastic loader counts
    the batches already taken with the old size plus the rest with the new one). Lightning reads that length only in
    ``_FitLoop.setup_data`` and caches it in: ``CombinedLoader.limits`` (``_parse_num_batches`` of each length, also
    copied into the live ``_ModeIterator.limits``), ``_FitLoop.max_batches`` (``trainer.num_training_batches``, which
    ``_TrainingEpochLoop._num_ready_batches_reached`` compares with the batches ready), ``_DataFetcher.length``/
    ``done`` (``is_last_batch``: the fetcher sets ``done = fetched >= length`` after each batch), and
    ``trainer.val_check_batch`` (``int(max_batches * val_check_interval)`` for a float interval: end-of-epoch
    validation runs when ``(batch_idx + 1) % val_check_batch == 0``). The progress bar's total is updated too.
    ``estimated_stepping_batches`` reads ``num_training_batches`` live.
    """
    from lightning.fabric.utilities.data import sized_len
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None:
        return None
    lengths = [sized_len(loader) for loader in combined.flattened]
    limit = trainer.limit_train_batches
    limits = [
        _parse_num_batches(RunningStage.TRAINING, float("inf") if length is None else length, limit)
        for length in lengths
    ]
    combined.limits = limits
    if combined._iterator is not None:
        combined._iterator.limits = limits
        max_batches = sized_len(combined)
    else:
        max_batches = max(limits) if limits else None
    fit_loop.max_batches = float("inf") if max_batches is None else max_batches
    _refresh_fetcher(fit_loop._data_fetcher, max_batches)
    _refresh_val_check_batch(trainer)
    _refresh_progress_bar_total(trainer)
    return fit_loop.max_batches


def _refresh_fetcher(fetcher: Any, length: int | float | None) -> None:
    """``_DataFetcher.length`` (set in ``reset``) and ``done`` (``fetched >= length``, else set at StopIteration)."""
    if fetcher is None or fetcher.length is None or length is None:
        return
    fetcher.length = length
    fetcher.done = fetcher.fetched >= length


def _refresh_val_check_batch(trainer: pl.Trainer) -> None:
    """``_FitLoop.setup_data``'s rule for ``val_check_batch``: an int interval and time-based validation are not
    relative to the epoch length; a float interval is."""
    max_batches = trainer.fit_loop.max_batches
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return
    if isinstance(trainer.val_check_interval, int) or max_batches == float("inf"):
        return
    trainer.val_check_batch = max(1, int(max_batches * trainer.val_check_interval))


def _refresh_progress_bar_total(trainer: pl.Trainer) -> None:
    """``TQDMProgressBar.on_train_epoch_start`` set the bar's total from ``num_training_batches``."""
    for callback in trainer.callbacks:
        if isinstance(callback, TQDMProgressBar) and callback._train_progress_bar is not None:
            callback._train_progress_bar.total = _finite(trainer.num_training_batches)


def _finite(total: int | float) -> int | None:
    return None if total == float("inf") else int(total)


def sharded_checkpoint_metadata_name() -> str:
    """The file beside a sharded checkpoint's DCP shards holding the rest of the checkpoint (loops, callbacks):
    Lightning's ``lightning.fabric.utilities.load._METADATA_FILENAME`` (``"meta.pt"``), which its ``FSDPStrategy`` and
    ``ModelParallelStrategy`` write from rank 0 and test for (``_is_sharded_checkpoint``) when loading."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return _METADATA_FILENAME

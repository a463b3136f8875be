"""Sharded checkpoints in Lightning's layout: a directory of ``torch.distributed.checkpoint`` (DCP) shards plus a
metadata file, written by every member together and resharded on load to any world size (issue 24).

Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy(state_dict_type="sharded")`` write a directory holding a DCP
checkpoint of ``{"state_dict" (ModelParallel) or "model" (FSDP): the model's state, "optimizer_<i>": each optimizer's}``
and, from rank 0, the rest of the Lightning checkpoint (loops, callbacks, schedulers) in one ``torch.save`` file (its
name is Lightning's, passed in by the caller). This module imports no Lightning: both class trees share it.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["MODEL_KEYS", "ShardedOptimizerState", "is_sharded_checkpoint", "load_model_state", "model_key",
           "optimizer_keys", "save_sharded"]

MODEL_KEYS = ("state_dict", "model")
"""The model's key in the DCP checkpoint: ``ModelParallelStrategy``'s (and ours), then ``FSDPStrategy``'s."""
OPTIMIZER_PREFIX = "optimizer_"


def is_sharded_checkpoint(path: Any, metadata_name: str) -> bool:
    """A directory with the metadata file (Lightning's test, ``fabric/strategies/fsdp.py::_is_sharded_checkpoint``)."""
    if not isinstance(path, (str, Path)):
        return False
    path = Path(path)
    return path.is_dir() and (path / metadata_name).is_file()


def _top_level_keys(path: Path) -> set[str]:
    """The first component of every key the DCP checkpoint holds (``state_dict``, ``optimizer_0``, …)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def model_key(path: Path) -> str:
    """The key the model's state is under, or a ``ValueError`` naming what the directory holds."""
    keys = _top_level_keys(path)
    for key in MODEL_KEYS:
        if key in keys:
            return key
    raise ValueError(f"the sharded checkpoint {str(path)!r} holds no model state (none of {MODEL_KEYS}): "
                     f"it holds {sorted(keys)}")


def optimizer_keys(path: Path) -> list[str]:
    """``optimizer_0``, ``optimizer_1``, … as the checkpoint holds them, in order."""
    keys = [key for key in _top_level_keys(path) if key.startswith(OPTIMIZER_PREFIX)]
    return sorted(keys, key=lambda key: int(key[len(OPTIMIZER_PREFIX):]))


def save_sharded(checkpoint: dict[str, Any], path: Path, metadata_name: str, group: Any, coordinator: bool,
                 barrier: Any) -> None:
    """Every member writes its shards of ``checkpoint``'s model and optimizer states into ``path`` (a collective over
    ``group``, None: the default group); then the coordinator writes the rest. A file or an older directory at
    ``path`` is removed first, and the metadata file comes last, so an interrupted save is never taken for a
    checkpoint."""
    from torch.distributed.checkpoint import save

    if coordinator and path.exists():
        path.unlink() if path.is_file() or path.is_symlink() else shutil.rmtree(path)
    barrier()
    path.mkdir(parents=True, exist_ok=True)
    shards = {"state_dict": checkpoint.pop("state_dict")}
    shards.update({f"{OPTIMIZER_PREFIX}{index}": state
                   for index, state in enumerate(checkpoint.pop("optimizer_states", []))})
    save(shards, checkpoint_id=path, process_group=group)
    if coordinator:
        torch.save(checkpoint, path / metadata_name)
    log.debug("sharded checkpoint written to %s", path)


def load_model_state(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """The model state of the checkpoint as whole tensors shaped like ``template``'s (this process reads all of it,
    with no collective); keys the checkpoint lacks are left out (a strict load then names them)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    key = model_key(path)
    held = {name.split(".", 1)[1] for name in FileSystemReader(path).read_metadata().state_dict_metadata
            if name.startswith(key + ".")}
    state = {name: value for name, value in template.items() if name in held}
    if any(isinstance(value, torch.Tensor) and value.is_meta for value in state.values()):
        return state  # a module built on the meta device (a joiner's): its state comes from its source
    wanted = {key: state}
    load(wanted, checkpoint_id=path, no_dist=True)
    return wanted[key]


@dataclass(frozen=True)
class ShardedOptimizerState:
    """Stands for an optimizer's state in a loaded checkpoint: it is read from ``path`` once the optimizer exists."""

    path: Path
    key: str

    def load_into(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Read this process's part of the state (its shards, or all of it for an unsharded module) and load it."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        wanted = {self.key: get_optimizer_state_dict(module, optimizer)}
        load(wanted, checkpoint_id=self.path, no_dist=True)
        set_optimizer_state_dict(module, optimizer, wanted[self.key], options=StateDictOptions(strict=True))


def shard_like(full: Any, template: Any) -> Any:
    """``full`` (a whole state: tensors, dicts, lists) with each plain tensor that is a ``DTensor`` in ``template``
    cut to this process's shard locally (``distribute_tensor(..., src_data_rank=None)``: no collective, so it works
    on an elastic generation's mesh, where torch's scatter from rank 0 cannot resolve the group); a DTensor as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(full, dict) and isinstance(template, dict):
        return {key: shard_like(value, template.get(key)) for key, value in full.items()}
    if isinstance(full, list) and isinstance(template, list) and len(full) == len(template):
        return [shard_like(value, like) for value, like in zip(full, template, strict=True)]
    if isinstance(full, torch.Tensor) and not isinstance(full, DTensor) and isinstance(template, DTensor):
        whole = full.to(device=template.device, dtype=template.dtype)
        return distribute_tensor(whole, template.device_mesh, template.placements, src_data_rank=None)
    return full

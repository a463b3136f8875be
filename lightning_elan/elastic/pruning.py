"""Pruned tensors (``torch.nn.utils.prune``, Lightning's ``ModelPruning``) follow a joiner.

Pruning reparametrises a module's tensor ``w``: the parameter becomes ``w_orig``, a buffer ``w_mask`` holds the mask,
and a forward pre-hook computes ``w = w_orig * w_mask``. A joiner builds its module fresh, unpruned, and a Lightning
checkpoint holds the pruned tensors made permanent (``ModelPruning.on_save_checkpoint``): from that alone a joiner
would train the unmasked network (the pruned weights grow back) and the ranks would drift apart. So the source also
sends each pruned tensor's ``_orig`` and ``_mask`` (:func:`pruned_tensors`), and the joiner reparametrises the same
tensors before it receives them (:func:`prune_as`): its parameter object stays the one an optimizer built before holds,
and ``_orig`` keeps the parameter's place in its module, so an optimizer built after (Lightning builds a joiner's after
it joined) lists the parameters in the order the members' optimizers, built before the pruning, do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import prune

from lightning_elan.torch_compat import move_parameter

log = logging.getLogger(__name__)

__all__ = ["prune_as", "pruned_tensors", "without_pruned"]

ORIG, MASK = "_orig", "_mask"


def pruned_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each pruned tensor's ``<name>_orig`` parameter and ``<name>_mask`` buffer, by their names in ``module``."""
    found: dict[str, torch.Tensor] = {}
    for prefix, submodule in module.named_modules():
        for name in _pruned_names(submodule):
            found[_join(prefix, name + ORIG)] = getattr(submodule, name + ORIG)
            found[_join(prefix, name + MASK)] = getattr(submodule, name + MASK)
    return found


def prune_as(module: nn.Module, source: dict[str, object]) -> None:
    """Reparametrise the tensors the source had pruned (named by :func:`pruned_tensors`' keys) and this ``module``
    has not: an identity pruning (a mask of ones, which the source's mask then overwrites)."""
    modules = dict(module.named_modules())
    for base in _pruned_bases(source):
        prefix, _, name = base.rpartition(".")
        submodule = modules.get(prefix)
        own = [own_name for own_name, _ in submodule.named_parameters(recurse=False)] if submodule else []
        if name in own:
            prune.identity(submodule, name)
            move_parameter(submodule, name + ORIG, own.index(name))  # where the source's optimizer saw it
            log.debug("pruning: %s reparametrised as its source's", base)


def without_pruned(state_dict: dict[str, object], pruned: dict[str, object]) -> dict[str, object]:
    """A checkpoint's ``state_dict`` with each pruned tensor as its ``_orig`` and ``_mask`` (what the pruned module
    loads) in place of the permanent value ``ModelPruning`` saved."""
    bases = set(_pruned_bases(pruned))
    return {**{key: value for key, value in state_dict.items() if key not in bases}, **pruned}


def _pruned_bases(names: Iterable[str]) -> list[str]:
    """The full names of the pruned tensors among state names: a ``<base>_mask`` with a ``<base>_orig`` beside it."""
    names = set(names)
    return [key[: -len(MASK)] for key in sorted(names) if key.endswith(MASK) and key[: -len(MASK)] + ORIG in names]


def _pruned_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s own pruned tensors: a ``<name>_mask`` buffer beside a ``<name>_orig`` parameter."""
    parameters = {name for name, _ in module.named_parameters(recurse=False)}
    return [name[: -len(MASK)] for name, _ in module.named_buffers(recurse=False)
            if name.endswith(MASK) and name[: -len(MASK)] + ORIG in parameters]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name

"""Tied weights through the live reshard: the aliases of a shared parameter (``fsdp_reshard.tied_aliases``) and the
meta parameters FSDP2 is taken off to (``torch_compat._parameters_to_meta`` keeps them shared)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_elan import torch_compat
from lightning_elan.replication import fsdp_reshard


class TiedLM(nn.Module):
    """GPT-2's shape of tie: the head's weight is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight


def test_a_tied_parameter_is_listed_under_its_first_name_with_its_other_names() -> None:
    assert fsdp_reshard.tied_aliases(TiedLM()) == {"embedding.weight": ["head.weight"]}
    assert fsdp_reshard.tied_aliases(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == {}


def test_a_loaded_parameter_is_registered_under_its_aliases() -> None:
    model = TiedLM()
    model.embedding.weight = nn.Parameter(torch.ones(10, 4))  # what loading the new shard does: the tie is cut
    assert model.head.weight is not model.embedding.weight
    fsdp_reshard._tie(model, "embedding.weight", ["head.weight"])
    assert model.head.weight is model.embedding.weight
    assert [name for name, _ in model.named_parameters()] == ["embedding.weight", "body.weight", "body.bias"]


def test_fsdp2_taken_off_a_tied_model_leaves_one_shared_meta_parameter() -> None:
    """On a real one-process mesh: ``fully_shard`` keeps the tie (one sharded parameter); taking FSDP2 off must leave
    one meta parameter in both places, so that sharding again on another mesh finds it shared (before: two, the
    head's never loaded by the reshard)."""
    with torch.device("meta"):
        model = TiedLM()
    mesh = torch_compat.solo_mesh("cpu", "tied_first")
    fully_shard(model.body, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.head.weight is model.embedding.weight
    torch_compat.undo_fully_shard(model)
    assert model.embedding.weight.is_meta and model.head.weight is model.embedding.weight
    fully_shard(model, mesh=torch_compat.solo_mesh("cpu", "tied_second"))
    assert model.head.weight is model.embedding.weight
    assert fsdp_reshard.tied_aliases(model) == {"embedding.weight": ["head.weight"]}

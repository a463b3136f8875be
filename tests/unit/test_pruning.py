"""A joiner's module pruned as its source's (``lightning_elan.elastic.pruning``), with torch's own pruning."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import prune

from lightning_elan.elastic.pruning import prune_as, pruned_tensors, without_pruned


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def test_a_fresh_module_pruned_as_the_source_computes_what_the_source_computes() -> None:
    source, joiner = make(), make()
    prune.l1_unstructured(source[0], "weight", amount=0.25)
    prune.l1_unstructured(source[0], "weight", amount=0.25)  # a second pruning: a PruningContainer
    prune.random_unstructured(source[2], "bias", amount=1.0)
    with torch.no_grad():
        source[0].weight_orig.add_(1.0)  # the source trained on: its values differ from the joiner's
    sent = pruned_tensors(source)
    assert sorted(sent) == ["0.weight_mask", "0.weight_orig", "2.bias_mask", "2.bias_orig"]
    weight = joiner[0].weight
    optimizer = torch.optim.SGD(joiner.parameters(), lr=0.1)

    prune_as(joiner, sent)
    own = joiner.state_dict(keep_vars=True)
    for key, tensor in sent.items():
        own[key].data.copy_(tensor)  # what the reception does into the destinations
    joiner.load_state_dict(without_pruned(source.state_dict(), sent))

    assert joiner[0].weight_orig is weight and optimizer.param_groups[0]["params"][0] is weight
    # an optimizer built now lists the parameters as one built before the pruning (Lightning builds a joiner's then)
    assert [id(p) for p in joiner.parameters()] == [id(p) for p in optimizer.param_groups[0]["params"]]
    assert [name for name, _ in joiner[0].named_parameters()] == ["weight_orig", "bias"]
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(joiner(x), source(x))
    assert int((joiner[0].weight == 0).sum()) == int((source[0].weight == 0).sum()) > 0
    prune.l1_unstructured(source[0], "weight", amount=0.25)  # both prune on: the same masks
    prune.l1_unstructured(joiner[0], "weight", amount=0.25)
    assert torch.equal(joiner[0].weight_mask, source[0].weight_mask)


def test_the_permanent_values_a_checkpoint_holds_give_way_to_orig_and_mask() -> None:
    state = {"0.weight": torch.zeros(2), "0.bias": torch.ones(2)}
    pruned = {"0.weight_orig": torch.full((2,), 3.0), "0.weight_mask": torch.ones(2)}
    assert sorted(without_pruned(state, pruned)) == ["0.bias", "0.weight_mask", "0.weight_orig"]
    assert pruned_tensors(make()) == {}
    module = make()
    prune_as(module, {})
    assert not prune.is_pruned(module)


def test_a_buffer_whose_name_ends_in_mask_is_not_taken_for_pruning() -> None:
    module = make()
    module[0].register_buffer("attention_mask", torch.ones(3))
    prune_as(module, {"0.attention_mask": None, "0.weight_mask": None})  # no "_orig" beside either
    assert not prune.is_pruned(module)

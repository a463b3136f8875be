"""KeptAttributes: a user's lists, dicts, counters and small tensors put back as they were when redone work began."""

from __future__ import annotations

import collections

import numpy
import torch

from lightning_elan.kept_attributes import MAX_DEPTH, MAX_SCANNED, MAX_TENSOR_ELEMENTS, KeptAttributes


class Owner:
    def __init__(self) -> None:
        self.outputs: list[int] = [1, 2]
        self.per_loader: dict[int, list[int]] = {0: [1], 1: []}
        self.seen: set[int] = {7}
        self.recent: collections.deque[int] = collections.deque([1, 2, 3], maxlen=3)
        self.count = 4
        self.framework: list[int] = []


def keep_all_but_framework(owner: object, name: str) -> bool:
    return name != "framework"


def test_appended_items_are_taken_out_and_the_users_reference_stays_valid() -> None:
    owner = Owner()
    outputs = owner.outputs
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.outputs.append(3)
    owner.seen.add(8)
    owner.recent.append(4)

    kept.restore()

    assert owner.outputs is outputs and outputs == [1, 2]
    assert owner.seen == {7}
    assert list(owner.recent) == [1, 2, 3] and owner.recent.maxlen == 3


def test_a_cleared_list_and_a_reassigned_attribute_come_back() -> None:
    owner = Owner()
    first = owner.outputs
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.outputs.clear()
    owner.outputs = [9]  # an epoch-end hook that makes a new list

    kept.restore()

    assert owner.outputs is first and first == [1, 2]


def test_nested_containers_are_put_back_down_to_the_depth_kept() -> None:
    owner = Owner()
    inner = owner.per_loader[1]
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.per_loader[1].append(5)
    owner.per_loader[2] = [6]

    kept.restore()

    assert owner.per_loader == {0: [1], 1: []} and owner.per_loader[1] is inner


def test_containers_deeper_than_the_limit_are_left_as_they_are() -> None:
    owner = Owner()
    deepest: list[int] = []
    nested: list[object] = [deepest]
    for _ in range(MAX_DEPTH - 1):
        nested = [nested]
    owner.outputs = nested  # type: ignore[assignment]
    kept = KeptAttributes([owner], keep_all_but_framework)
    deepest.append(1)

    kept.restore()

    assert deepest == [1]
    assert len(kept) == MAX_DEPTH + 3 + 2  # the chain down to the limit; per_loader and its two lists; seen; recent


def test_the_containers_in_a_long_one_are_not_looked_into() -> None:
    owner = Owner()
    owner.outputs = [[step] for step in range(MAX_SCANNED + 1)]  # type: ignore[misc]
    first = owner.outputs[0]
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.outputs.append([99])
    first.append(1)

    kept.restore()

    assert len(owner.outputs) == MAX_SCANNED + 1 and first == [0, 1]


def test_what_keep_refuses_and_an_object_of_the_users_own_are_not_touched() -> None:
    owner = Owner()
    owner.tracker = Loss(1.0)  # type: ignore[attr-defined]
    tracker = owner.tracker  # type: ignore[attr-defined]
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.framework.append(1)
    tracker.value = 2.0

    kept.restore()

    assert owner.framework == [1] and owner.tracker is tracker and tracker.value == 2.0  # type: ignore[attr-defined]


def test_numbers_strings_and_tuples_get_their_values_back() -> None:
    owner = Owner()
    owner.loss_sum = 0.5  # type: ignore[attr-defined]
    owner.phase = "warmup"  # type: ignore[attr-defined]
    owner.shape = (1, 2)  # type: ignore[attr-defined]
    owner.best = None  # type: ignore[attr-defined]
    owner.numpy_count = numpy.int64(3)  # type: ignore[attr-defined]
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.count += 1
    owner.loss_sum += 0.25  # type: ignore[attr-defined]
    owner.phase, owner.shape, owner.best = "main", (3,), 1.0  # type: ignore[attr-defined]
    owner.numpy_count += 1  # type: ignore[attr-defined]

    kept.restore()

    assert (owner.count, owner.loss_sum, owner.phase, owner.shape, owner.best) == (4, 0.5, "warmup", (1, 2), None)  # type: ignore[attr-defined]
    assert owner.numpy_count == 3  # type: ignore[attr-defined]


def test_a_small_tensor_changed_in_place_or_replaced_comes_back_in_place() -> None:
    owner = Owner()
    owner.ema = torch.zeros(3, dtype=torch.float64)  # type: ignore[attr-defined]
    owner.total = torch.tensor(2.0)  # type: ignore[attr-defined]
    ema = owner.ema  # type: ignore[attr-defined]
    total = owner.total  # type: ignore[attr-defined]
    kept = KeptAttributes([owner], keep_all_but_framework)
    owner.ema.mul_(0.9).add_(1.0)  # type: ignore[attr-defined]
    owner.total = owner.total + 1  # type: ignore[attr-defined]
    total.add_(5)

    kept.restore()

    assert owner.ema is ema and torch.equal(ema, torch.zeros(3, dtype=torch.float64))  # type: ignore[attr-defined]
    assert owner.total is total and float(total) == 2.0  # type: ignore[attr-defined]
    assert len(kept) == 2 + 6  # two tensors' contents; outputs, per_loader and its two lists, seen, recent


def test_a_large_tensor_or_one_that_needs_a_gradient_gets_its_reference_back_only() -> None:
    owner = Owner()
    owner.cache = torch.zeros(MAX_TENSOR_ELEMENTS + 1)  # type: ignore[attr-defined]
    owner.last_loss = torch.ones(1, requires_grad=True) * 2  # type: ignore[attr-defined]
    cache, last_loss = owner.cache, owner.last_loss  # type: ignore[attr-defined]
    kept = KeptAttributes([owner], keep_all_but_framework)
    cache.add_(1)
    owner.cache = torch.ones(1)  # type: ignore[attr-defined]
    owner.last_loss = torch.zeros(1)  # type: ignore[attr-defined]

    kept.restore()

    assert owner.cache is cache and float(cache.sum()) == MAX_TENSOR_ELEMENTS + 1  # type: ignore[attr-defined]
    assert owner.last_loss is last_loss  # type: ignore[attr-defined]


def test_a_parameter_is_no_attribute_to_keep() -> None:
    owner = Owner()
    owner.scale = torch.nn.Parameter(torch.ones(2))  # type: ignore[attr-defined]
    kept = KeptAttributes([owner], keep_all_but_framework)
    with torch.no_grad():
        owner.scale.add_(1)  # type: ignore[attr-defined]

    kept.restore()

    assert torch.equal(owner.scale, torch.full((2,), 2.0))  # type: ignore[attr-defined]


def test_a_container_shared_by_two_owners_is_kept_once() -> None:
    first, second = Owner(), Owner()
    second.outputs = first.outputs
    kept = KeptAttributes([first, second], keep_all_but_framework)
    first.outputs.append(3)

    kept.restore()

    assert second.outputs is first.outputs and first.outputs == [1, 2]


class Loss:
    def __init__(self, value: float) -> None:
        self.value = value


def test_the_elements_themselves_are_not_copied() -> None:
    owner = Owner()
    loss = Loss(1.0)
    owner.outputs = [loss]  # type: ignore[list-item]
    kept = KeptAttributes([owner], lambda owner, name: name == "outputs")
    loss.value = 2.0

    kept.restore()

    assert owner.outputs[0] is loss and loss.value == 2.0


def test_a_dict_of_a_steps_outputs_is_kept_as_it_was_appended() -> None:
    owner = Owner()
    row = {"loss": 1.0}
    owner.outputs = [row]  # type: ignore[list-item]
    kept = KeptAttributes([owner], lambda owner, name: name == "outputs")
    row["preds"] = 2.0
    owner.outputs.append({"loss": 3.0})  # type: ignore[arg-type]

    kept.restore()

    assert owner.outputs == [{"loss": 1.0}] and owner.outputs[0] is row

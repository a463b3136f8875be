"""Unit tests for lightning_elan.replication.packing (and an in-process transport round trip)."""

from __future__ import annotations

import datetime
import pickle
import threading
from collections import Counter, OrderedDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_elan.replication import packing
from lightning_elan.replication.packing import (
    PackedLayout,
    TensorRef,
    TensorSpec,
    allocate_like,
    chunk_layout,
    empty_buffers,
    fill_chunk,
    join_tensors,
    make_layout,
    pack,
    split_tensors,
    state_nbytes,
    unpack,
)
from lightning_elan.replication.transports import Channel, CollectiveTransport
from lightning_elan.replication.transports import collective as collective_module

Point = namedtuple("Point", ["x", "y"])

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a_bytes = a.detach().reshape(-1).contiguous().view(torch.uint8)
    b_bytes = b.detach().reshape(-1).contiguous().view(torch.uint8)
    return torch.equal(a_bytes, b_bytes)


def assert_same_state(expected: Any, actual: Any, path: str = "root") -> None:
    """Recursive equality: same container types and keys; tensors bit-equal; leaves ==."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert bit_equal(expected, actual), f"{path}: tensors differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys differ"
        for key in expected:
            assert_same_state(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_state(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def trained_model_and_adam(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def checkpoint_like(seed: int = 0) -> dict[str, Any]:
    model, optimizer = trained_model_and_adam(seed)
    return {
        "epoch": 3,
        "global_step": 17,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [{"last_epoch": 17, "base_lrs": [0.01], "_step_count": 18}],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "callbacks": OrderedDict(ModelCheckpoint={"best_model_score": torch.tensor(0.25), "path": None}),
        "rng": (torch.get_rng_state(), "python", 42),
        "hparams": {"name": "tiny", "layers": (5, 7, 3), "dropout": None, "tags": ["a", "b"]},
        "point": Point(torch.arange(3), 1.5),
        "counts": defaultdict(int, {"a": 1}),
    }


def mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 10, generator=g, dtype=torch.float64)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-300, -3.5])
    out = [
        torch.tensor(3.25),  # 0-dim float32
        torch.tensor(7, dtype=torch.int64),  # 0-dim int64
        torch.tensor(True),  # 0-dim bool
        torch.empty(0),  # empty float32
        torch.empty(0, 4, dtype=torch.float64),  # empty, 2-D
        torch.empty(3, 0, dtype=torch.int64),
        base.t(),  # non-contiguous (transposed) float64
        base[::2, 1::3],  # non-contiguous (strided slice) float64
        torch.randint(0, 2, (5, 3), generator=g).bool(),
        torch.randint(-(2**62), 2**62, (7,), generator=g, dtype=torch.int64),
        special.to(torch.float16),
        special.to(torch.bfloat16),
        special.to(torch.float32),
        special.to(torch.float64),
        torch.randn(13, generator=g).half(),
        torch.randn(3, 1, 5, generator=g).bfloat16(),
        torch.randn(1, generator=g),
        torch.randn(2, 3, generator=g, dtype=torch.float64),
        torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        torch.randn(4, generator=g, dtype=torch.complex64),
        torch.randn(4, 4, generator=g).t()[1:3],  # non-contiguous float32
    ]
    for dtype in ALL_DTYPES:  # one odd-sized tensor of every dtype
        out.append(torch.ones(11, dtype=dtype))
    return out


def transfer_locally(buffers: dict[str, torch.Tensor], layout: PackedLayout) -> dict[str, torch.Tensor]:
    """Pickle the layout, allocate poisoned receive buffers, copy bytes in (a local 'transfer')."""
    layout = pickle.loads(pickle.dumps(layout))
    received = empty_buffers(layout, lambda device_type: torch.device("cpu"))
    for buf in received.values():
        buf.view(torch.uint8).fill_(0xFF)
    for key in sorted(received):
        received[key].view(torch.uint8).copy_(buffers[key].view(torch.uint8))
    return received


# ---------------------------------------------------------------------------------------------
# split / join
# ---------------------------------------------------------------------------------------------


def test_split_join_round_trip_checkpoint_like() -> None:
    state = checkpoint_like()
    skeleton, tensors = split_tensors(state)

    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors)
    restored = join_tensors(skeleton, tensors)
    assert_same_state(state, restored)
    # the very same tensor objects come back
    assert restored["state_dict"]["0.weight"] is state["state_dict"]["0.weight"]
    assert restored["optimizer_states"][0]["state"][0]["exp_avg"] is state["optimizer_states"][0]["state"][0]["exp_avg"]


def test_split_skeleton_has_no_tensors_and_pickles() -> None:
    state = checkpoint_like()
    skeleton, tensors = split_tensors(state)

    def walk(value: Any) -> None:
        assert not isinstance(value, torch.Tensor)
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(skeleton)
    blob = pickle.dumps(skeleton)
    assert len(blob) < 10_000
    assert_same_state(state, join_tensors(pickle.loads(blob), tensors))


def test_split_keeps_container_types_and_metadata() -> None:
    state = checkpoint_like()
    skeleton, tensors = split_tensors(state)

    sd = skeleton["state_dict"]
    assert type(sd) is OrderedDict
    assert list(sd) == list(state["state_dict"])
    assert sd._metadata == state["state_dict"]._metadata  # load_state_dict's version info survives
    assert isinstance(sd["0.weight"], TensorRef)
    assert type(skeleton["rng"]) is tuple and skeleton["rng"][1:] == ("python", 42)
    assert type(skeleton["point"]) is Point and skeleton["point"].y == 1.5
    assert type(skeleton["counts"]) is defaultdict and skeleton["counts"].default_factory is int
    assert skeleton["hparams"] == state["hparams"]  # tensor-free subtrees are equal
    assert skeleton["optimizer_states"][0]["param_groups"] == state["optimizer_states"][0]["param_groups"]
    # the input is not modified
    assert isinstance(state["state_dict"]["0.weight"], torch.Tensor)
    assert len(tensors) == len({id(t) for t in tensors})


def test_a_counter_keeps_its_counts() -> None:
    """``MultiStepLR`` keeps its milestones in a ``Counter``: a joiner's scheduler must decay at the same epochs."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.04)
    state = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1, 2, 2], gamma=0.5).state_dict()

    skeleton, tensors = split_tensors(state)
    joined = join_tensors(skeleton, tensors)

    assert type(joined["milestones"]) is Counter and joined["milestones"] == Counter({1: 1, 2: 2})


def test_split_dedupes_the_same_tensor_object() -> None:
    shared = torch.randn(3)
    skeleton, tensors = split_tensors({"a": shared, "b": [shared, torch.zeros(1)]})
    assert len(tensors) == 2
    assert skeleton["a"] == skeleton["b"][0] == TensorRef(0)
    restored = join_tensors(skeleton, tensors)
    assert restored["a"] is restored["b"][0] is shared


def test_split_plain_values_and_bare_tensor() -> None:
    assert split_tensors(None) == (None, [])
    assert split_tensors([1, "x", (2.5, None)]) == ([1, "x", (2.5, None)], [])
    t = torch.ones(2)
    skeleton, tensors = split_tensors(t)
    assert skeleton == TensorRef(0) and tensors[0] is t


def test_loaded_state_restores_model_and_optimizer() -> None:
    """State that went split -> pack -> transfer -> unpack -> join loads into fresh objects."""
    model, optimizer = trained_model_and_adam(seed=0)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    skeleton, tensors = split_tensors(state)
    buffers, layout = pack(tensors)
    received = join_tensors(pickle.loads(pickle.dumps(skeleton)), unpack(transfer_locally(buffers, layout), layout))

    fresh_model, fresh_optimizer = trained_model_and_adam(seed=123)
    fresh_model.load_state_dict(received["model"])
    fresh_optimizer.load_state_dict(received["optimizer"])
    assert_same_state(model.state_dict(), fresh_model.state_dict())
    assert_same_state(optimizer.state_dict(), fresh_optimizer.state_dict())


# ---------------------------------------------------------------------------------------------
# pack / unpack
# ---------------------------------------------------------------------------------------------


def test_pack_unpack_bit_exact_mixed_dtypes() -> None:
    tensors = mixed_tensors()
    buffers, layout = pack(tensors)
    out = unpack(buffers, layout)

    assert len(out) == len(tensors)
    for i, (src, dst) in enumerate(zip(tensors, out, strict=True)):
        assert dst.dtype == src.dtype, i
        assert dst.shape == src.shape, i
        assert bit_equal(src, dst), i
        if not src.dtype.is_floating_point or not torch.isnan(src).any():
            assert torch.equal(src, dst), i


def test_pack_layout_one_buffer_per_device_and_dtype() -> None:
    tensors = mixed_tensors()
    buffers, layout = pack(tensors)

    keys = {f"cpu:{t.dtype}" for t in tensors}
    assert set(buffers) == set(layout.buffer_numels) == keys
    assert list(buffers) == sorted(buffers)
    assert "cpu:torch.float64" in buffers and "cpu:torch.bfloat16" in buffers
    for key, buf in buffers.items():
        assert buf.dim() == 1 and buf.is_contiguous()
        assert str(buf.dtype) == key.split(":", 1)[1]
        assert buf.numel() == layout.buffer_numels[key]
        assert buf.numel() == sum(t.numel() for t in tensors if f"cpu:{t.dtype}" == key)
    assert state_nbytes(buffers) == sum(t.numel() * t.element_size() for t in tensors)
    assert all(isinstance(s, TensorSpec) for s in layout.specs)
    spec = layout.specs[6]  # base.t()
    assert (spec.dtype, spec.shape, spec.device_type) == ("torch.float64", (10, 6), "cpu")


def test_pack_copies_and_does_not_alias_sources() -> None:
    src = torch.arange(6.0)
    buffers, layout = pack([src, torch.ones(2)])
    src.add_(100)
    assert torch.equal(unpack(buffers, layout)[0], torch.arange(6.0))


def test_pack_empty_list() -> None:
    buffers, layout = pack([])
    assert buffers == {} and layout.specs == [] and layout.buffer_numels == {}
    assert unpack(buffers, layout) == []
    assert state_nbytes(buffers) == 0


def test_pack_all_empty_tensors() -> None:
    buffers, layout = pack([torch.empty(0), torch.empty(2, 0)])
    assert buffers["cpu:torch.float32"].numel() == 0
    assert [t.shape for t in unpack(buffers, layout)] == [torch.Size([0]), torch.Size([2, 0])]


def test_pack_rejects_sparse() -> None:
    with pytest.raises(TypeError, match="dense"):
        pack([torch.eye(3).to_sparse()])


def test_unpack_returns_views_into_buffers() -> None:
    tensors = [torch.zeros(2, 3), torch.tensor(1.0), torch.zeros(4, dtype=torch.int64)]
    buffers, layout = pack(tensors)
    out = unpack(buffers, layout)

    f32 = buffers["cpu:torch.float32"]
    for view in out[:2]:
        assert view.untyped_storage().data_ptr() == f32.untyped_storage().data_ptr()
    out[0][1, 2] = 5.0  # view -> buffer
    assert f32[5].item() == 5.0
    out[1].fill_(9.0)
    assert f32[6].item() == 9.0
    buffers["cpu:torch.int64"][3] = 42  # buffer -> view
    assert out[2][3].item() == 42


def test_unpack_restores_requires_grad_only_where_it_applies() -> None:
    param = nn.Parameter(torch.randn(3, 2))
    tensors = [param, torch.randn(2), torch.arange(3)]
    buffers, layout = pack(tensors)
    assert [s.requires_grad for s in layout.specs] == [True, False, False]
    # a hand-made layout claiming requires_grad on an integer tensor is ignored for that tensor
    layout.specs[2].requires_grad = True
    out = unpack(buffers, layout)
    assert out[0].requires_grad and out[0].is_leaf
    assert not out[1].requires_grad
    assert not out[2].requires_grad
    assert not buffers["cpu:torch.float32"].requires_grad


def test_empty_buffers_uses_device_for_and_sorted_keys() -> None:
    _, layout = pack(mixed_tensors())
    asked: list[str] = []

    def device_for(device_type: str) -> torch.device:
        asked.append(device_type)
        return torch.device("cpu")

    buffers = empty_buffers(layout, device_for)
    assert list(buffers) == sorted(layout.buffer_numels)
    assert set(asked) == {"cpu"}
    for key, buf in buffers.items():
        assert buf.numel() == layout.buffer_numels[key]
        assert str(buf.dtype) == key.split(":", 1)[1]


def test_dtype_from_str() -> None:
    for dtype in ALL_DTYPES:
        assert packing.dtype_from_str(str(dtype)) is dtype
    with pytest.raises(ValueError):
        packing.dtype_from_str("torch.not_a_dtype")
    with pytest.raises(ValueError):
        packing.dtype_from_str("torch.Tensor")


def test_poisoned_receive_buffers_are_fully_overwritten_by_local_transfer() -> None:
    tensors = mixed_tensors()
    buffers, layout = pack(tensors)
    out = unpack(transfer_locally(buffers, layout), layout)
    for src, dst in zip(tensors, out, strict=True):
        assert bit_equal(src, dst)


def test_poisoned_receive_buffers_are_fully_overwritten_by_gloo_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Source and destination in two threads over a HashStore and real Gloo groups."""
    poisoned: list[torch.Tensor] = []

    def poisoned_empty_buffers(layout: PackedLayout, device_for: Any) -> dict[str, torch.Tensor]:
        buffers = packing.empty_buffers(layout, device_for)
        for buf in buffers.values():
            buf.view(torch.uint8).fill_(0xFF)  # NaN for floats, -1 / True for integers / bools
            poisoned.append(buf)
        return buffers

    monkeypatch.setattr(collective_module, "empty_buffers", poisoned_empty_buffers)
    state = checkpoint_like()
    state["mixed"] = mixed_tensors()
    skeleton, tensors = split_tensors(state)
    store = dist.HashStore()
    results: dict[str, Any] = {}

    channel = Channel(store, "t0", datetime.timedelta(seconds=60))
    sender = CollectiveTransport(channel)

    def source() -> None:
        results["sent"] = sender.send(skeleton, tensors, readers=1)
        sender.disallow()

    def destination() -> None:
        got = CollectiveTransport(channel).receive(0, lambda _: torch.device("cpu"))
        results["received"] = got.cpu_state, got.tensors, got.nbytes

    threads = [threading.Thread(target=source), threading.Thread(target=destination)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)

    cpu_state, received, nbytes = results["received"]
    assert nbytes == results["sent"] > 0
    poisoned_ptrs = {buf.untyped_storage().data_ptr() for buf in poisoned}
    assert all(t.untyped_storage().data_ptr() in poisoned_ptrs for t in received if t.numel())
    assert_same_state(state, join_tensors(cpu_state, received))
    assert not dist.is_initialized()
    sender.shutdown()
    assert store.list_keys() == []  # header, acknowledgement and the group's rendezvous keys deleted


def test_chunks_cover_each_buffer_in_whole_tensors_and_fill_it_like_pack() -> None:
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, 4, dtype=torch.float64),
               torch.arange(6, dtype=torch.float32).view(2, 3).t(), torch.empty(0), torch.full((5,), 7.0)]
    layout = make_layout(tensors)
    chunks = chunk_layout(layout, chunk_bytes=40)  # 10 float32 = 40 bytes: the first tensor closes a chunk
    assert [(c.key, c.start, c.end, c.specs) for c in chunks] == [
        ("cpu:torch.float32", 0, 10, (0,)), ("cpu:torch.float32", 10, 21, (2, 4)), ("cpu:torch.float64", 0, 12, (1,)),
    ]
    buffers = allocate_like(layout, tensors)
    for chunk in chunks:
        fill_chunk(buffers, layout, chunk, tensors)
    expected, _ = pack(tensors)
    assert buffers.keys() == expected.keys()
    for key in expected:
        assert torch.equal(buffers[key], expected[key])
    assert all(torch.equal(a, b) for a, b in zip(unpack(buffers, layout), tensors, strict=True))


def test_one_chunk_per_buffer_when_the_chunk_is_larger_than_the_state() -> None:
    layout = make_layout([torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.int64)])
    assert [(c.key, c.start, c.end) for c in chunk_layout(layout, 1 << 20)] == [
        ("cpu:torch.float32", 0, 8), ("cpu:torch.int64", 0, 2)]

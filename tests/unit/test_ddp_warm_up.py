"""``ElasticDistributedDataParallel.warm_up_alone``: a joiner's backward of zeros on its own, before it joins. It
touches the gradient buckets (the process's resident memory grows by them), leaves no gradient and no trace in
training (the next iterations equal an unwarmed DDP's bit for bit), and is skipped where it would run user code."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_elan.elastic.ddp import ElasticDistributedDataParallel


def _model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)).double()


def _resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024


def test_a_warmed_up_ddp_trains_as_an_unwarmed_one_bit_for_bit() -> None:
    model, reference = _model(), _model()
    warmed = ElasticDistributedDataParallel(model, lambda: None)
    plain = ElasticDistributedDataParallel(reference, lambda: None)
    assert warmed.warm_up_alone()
    assert all(parameter.grad is None for parameter in model.parameters())
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, reference)]
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        for ddp, optimizer in zip((warmed, plain), optimizers, strict=True):
            optimizer.zero_grad()
            ddp(x).pow(2).sum().backward()
            optimizer.step()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_the_warm_up_touches_the_gradient_buckets() -> None:
    model = torch.nn.Linear(4096, 4096, bias=False)  # 64 MiB of float32 gradients in the buckets
    ddp = ElasticDistributedDataParallel(model, lambda: None, bucket_cap_mb=16)
    before = _resident_bytes()
    assert ddp.warm_up_alone()
    assert _resident_bytes() - before >= 48 << 20


def test_no_warm_up_where_it_would_run_user_code_or_reach_peers() -> None:
    model = _model()
    calls = []
    model[0].weight.register_hook(lambda grad: calls.append(grad))
    assert not ElasticDistributedDataParallel(model, lambda: None).warm_up_alone()
    assert calls == []
    with_grads = _model()
    with_grads[0].weight.grad = torch.ones_like(with_grads[0].weight)
    assert not ElasticDistributedDataParallel(with_grads, lambda: None).warm_up_alone()
    assert torch.equal(with_grads[0].weight.grad, torch.ones_like(with_grads[0].weight))
    unused = ElasticDistributedDataParallel(_model(), lambda: None, find_unused_parameters=True)
    assert not unused.warm_up_alone()

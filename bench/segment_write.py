"""How long a source's send writes its state into a shared-memory segment: new, made ahead, or written before.

    python -m bench.segment_write --model 25m --repeats 5

A 25 M model's packed state with Adam (the parameters and two moments, float32: 309 MB) is written with the
shared-memory transport's own writer (``_write_segment``) into: a new tmpfs file (a send without a segment made ahead),
a segment just made by :class:`~lightning_elan.replication.send_segment.SendSegment` (the job's first adjustment with
``ELAN_SEND_AHEAD``), and the same segment again (a later adjustment). Prints the median and min–max of each over
``--repeats`` fresh rounds (ms). The first write goes into a new file and is not counted: it pays for the source
tensors' first reading, which a worker has paid before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.sizes import MODEL_SIZES
from lightning_elan.replication.packing import arena_layout, make_layout
from lightning_elan.replication.send_segment import SendSegment
from lightning_elan.replication.transports.shm import _write_segment


def _timed_write(fd: int, path: Path, tensors: list[torch.Tensor]) -> float:
    layout = make_layout(tensors)
    started = time.perf_counter()
    _write_segment(fd, path, tensors, layout, arena_layout(layout), lambda nbytes: None)
    return (time.perf_counter() - started) * 1e3


def _into_new_file(directory: Path, tensors: list[torch.Tensor], nbytes: int) -> float:
    path = directory / f"elan-bench-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return _timed_write(fd, path, tensors)
    finally:
        os.close(fd)
        path.unlink()


def _into_segment(segment: SendSegment, tensors: list[torch.Tensor], nbytes: int) -> float:
    prepared = segment.take(nbytes)
    assert prepared is not None, "the segment made ahead is missing"
    fd = os.dup(prepared.fd)
    try:
        return _timed_write(fd, prepared.path, tensors)
    finally:
        os.close(fd)
        segment.give_back(prepared)


def one_round(directory: Path, tensors: list[torch.Tensor]) -> dict[str, float]:
    nbytes = arena_layout(make_layout(tensors)).nbytes
    _into_new_file(directory, tensors, nbytes)  # the source tensors read once, as a training worker has
    times = {"new file": _into_new_file(directory, tensors, nbytes)}
    segment = SendSegment(directory)
    segment.prepare(nbytes)
    segment.wait()
    try:
        times["made ahead, first write"] = _into_segment(segment, tensors, nbytes)
        times["made ahead, rewrite"] = _into_segment(segment, tensors, nbytes)
    finally:
        segment.release()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="25m", help="tiny, 1m, 11m or 25m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory")
    args = parser.parse_args()
    numel = MODEL_SIZES[args.model].parameters()
    tensors = [torch.randn(numel), torch.zeros(numel), torch.zeros(numel)]  # weights, Adam's two moments
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="elan-bench-") as directory:
        rounds = [one_round(Path(directory), tensors) for _ in range(args.repeats)]
    print(f"{args.model}: {3 * numel * 4 / 1e6:.0f} MB, {args.repeats} rounds, load average {os.getloadavg()[0]:.1f}")
    for kind in rounds[0]:
        values = [r[kind] for r in rounds]
        print(f"  {kind:<26} {statistics.median(values):6.1f} ms ({min(values):.1f}–{max(values):.1f})")


if __name__ == "__main__":
    main()

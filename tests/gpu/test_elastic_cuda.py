"""The elastic end-to-end run on CUDA tensors: workers share one GPU, joiners copy the state over CUDA IPC (level L0).

Real `elan run` jobs of the float64 probe script with `accelerator="gpu"`; the process groups use gloo (NCCL refuses
two ranks on one GPU). Checked as on the CPU: each sample once per epoch, bit-identical workers at every step, final
parameters equal to a static run on the same GPU; and the plan's transport, level and the transport actually used.
"""

from __future__ import annotations

import re

import pytest

from tests.integration.elastic_runs import assert_each_sample_once, assert_ranks_agree, assert_states_close, elan_run

pytestmark = pytest.mark.gpu

SAMPLES, EPOCHS = 100, 3
GPU_ARGS = ["--samples", str(SAMPLES), "--batch-size", "6", "--epochs", str(EPOCHS), "--accelerator", "gpu",
            "--devices", "1", "--backend", "gloo", "--step-sleep", "0.2"]  # fmt: skip
RECEIVED = re.compile(r"worker (w\d+) received [\d.]+ MB of state from (w\d+) over (\S+)")


def test_grow_migrate_and_remove_rank0_on_cuda_over_cuda_ipc(tmp_path):
    static = elan_run(tmp_path, "static", 2, GPU_ARGS)
    assert static.returncode == 0, static.excerpt()
    run = elan_run(tmp_path, "cuda", 2, GPU_ARGS, schedule="3:add=2,9:migrate=1,15:remove=rank:0")
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == EPOCHS * 9
    assert_states_close(run.final_state(), static.final_state(), 1e-9)

    adjustments = run.adjustments(tmp_path / "cuda-state")
    assert [len(a["members"]) for a in adjustments] == [4, 4, 3]
    joins = [t for a in adjustments for t in (a["transfers"] or [])]
    assert len(joins) == 3
    assert {(t["transport"], t["level"]) for t in joins} == {("cuda_ipc", 0)}, joins
    assert len({t["source"] for t in adjustments[0]["transfers"]}) == 2, "two joiners, two sources"
    received = RECEIVED.findall(run.output)
    assert {transport for _, _, transport in received} == {"cuda_ipc"}
    assert len(received) == 3
    assert all(a["bytes_replicated"] > 0 for a in adjustments[:2])

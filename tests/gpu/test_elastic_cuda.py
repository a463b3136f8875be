"""The elastic end-to-end run on CUDA tensors: workers share one GPU, joiners copy the state over CUDA IPC (level L0).

Real `elan run` jobs of the float64 probe script with `accelerator="gpu"`; the process groups use gloo (NCCL refuses
two ranks on one GPU). Checked as on the CPU (``check_elastic_run``: each sample once per epoch, bit-identical workers
at every step, final parameters equal to a static run on the same GPU, the adjustments in order and where the protocol
allows them); and the plan's transport, level and the transport actually used.
"""

from __future__ import annotations

import pytest

from tests.integration.elastic_runs import PROBE_ARGS, check_elastic_run, check_static_run, elan_run, received_routes

pytestmark = pytest.mark.gpu

# --wait-for-joiners: rank 0 holds a batch until the joiners due at its step are ready (no effect on the numbers)
GPU_ARGS = [*PROBE_ARGS, "--accelerator", "gpu", "--devices", "1", "--backend", "gloo", "--wait-for-joiners"]


def test_grow_migrate_and_remove_rank0_on_cuda_over_cuda_ipc(tmp_path):
    static = check_static_run(elan_run(tmp_path, "static", 2, GPU_ARGS))
    schedule = "3:add=2,9:migrate=1,15:remove=rank:0"
    run = elan_run(tmp_path, "cuda", 2, GPU_ARGS, schedule=schedule)
    assert run.config()["accelerator"] == "gpu"
    adjustments = check_elastic_run(run, static, schedule, sizes=[4, 4, 3])
    joins = [t for a in adjustments for t in (a["transfers"] or [])]
    assert len(joins) == 3
    assert {(t["transport"], t["level"]) for t in joins} == {("cuda_ipc", 0)}, joins
    assert len({t["source"] for t in adjustments[0]["transfers"]}) == 2, "two joiners, two sources"
    routes = received_routes(run)
    assert routes == {t["joiner"]: (t["source"], "cuda_ipc") for t in joins}, "what the joiners actually used"
    assert all(a["bytes_replicated"] > 0 for a in adjustments[:2])

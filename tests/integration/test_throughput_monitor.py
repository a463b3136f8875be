"""From the user's side: Lightning's ``ThroughputMonitor`` in a job whose rank 0 leaves (``3:remove=rank:0``), then a
``validate`` after ``fit``. The monitor measures on rank 0 only; the stayer that becomes rank 0 goes on logging it,
the worker that left ends its script after ``fit`` (exit 0: its ``validate`` does not run), and the job trains as the
static run. Before, the new rank 0 failed in its first ``on_train_batch_end`` (``KeyError: <RunningStage.TRAINING:
'train'>``: the monitor's clock was started on the old rank 0 only), waited 60 s for a death that never came, and the
job hung; the leaver's ``validate`` failed with ``AssertionError`` (``Throughput(world_size=0)``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.users.corpus import Job, assert_ok, assert_states_close, read_csv, run_job

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "user_scripts" / "throughput_monitor.py"


def test_the_new_rank_0_goes_on_measuring_throughput(tmp_path: Path) -> None:
    static = run_job(tmp_path / "static", Job("static", (str(SCRIPT), "{out}")))
    assert_ok(static)
    elastic = run_job(tmp_path / "elastic", Job("elastic", (str(SCRIPT), "{out}"), schedule="3:remove=rank:0"))
    assert_ok(elastic)
    assert "Traceback" not in elastic.output and "exited with code 1" not in elastic.output, elastic.excerpt()
    assert [(a["action"], len(a["members"])) for a in elastic.adjustments()] == [("remove", 1)]
    _, rows = read_csv(elastic.out / "logs" / "metrics.csv")
    measured = sorted(int(row["step"]) for row in rows if row.get("train/samples"))
    assert measured[-1] == 15 and 4 in measured, f"the new rank 0 goes on measuring: steps {measured}"
    ranks = sorted(json.loads(path.read_text())["rank"] for path in elastic.out.glob("validated-*.json"))
    assert ranks == [0], "the stayer validated; the leaver's script ended after fit"
    assert re.search(r"w0 \(pid \d+\) exited with code 0 \(expected\)", elastic.output), elastic.excerpt()
    assert_states_close(torch.load(elastic.out / "final.pt"), torch.load(static.out / "final.pt"))

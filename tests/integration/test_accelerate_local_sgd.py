"""Accelerate's ``LocalSGD`` with ``split_batches=True`` (user loop ``accelerate_local_sgd_loop.py``) under the real
`elan run --nproc 2 --schedule 2:add=1`: a worker joins after step 2, so the job trains and evaluates at 3 processes.

Two bugs this loop found, each a failed or stuck job on the old code:

* a joiner's ``LocalSGD`` counted its steps from 0, so it averaged the models at other steps than the members: the
  members waited in the averaging's ``wait_for_everyone`` while the joiner trained on, and the job hung (until gloo's
  300 s timeout). The members' count now travels with the training state (``lightning_elan/accelerate/local_sgd.py``).
* the evaluation loader's batch size 8 does not split over 3 processes: Accelerate's ``BatchSamplerShard`` raised
  ``ValueError`` at the first evaluation after the join, on every process, and the job failed. Such a world now
  evaluates whole batches per process (``compat.shard_for_evaluation``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import committed_batches, loop_records, loop_run

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_local_sgd_loop.py")
TRAIN, VALIDATION, EPOCHS, STEPS = 48, 20, 2, 12  # a global batch of 8 at every world size: 6 steps per epoch


def test_a_joiner_averages_with_the_members_and_evaluates_at_a_world_that_does_not_split_the_batch(tmp_path):
    run = loop_run(tmp_path, "local_sgd", LOOP, schedule="2:add=1")
    assert run.returncode == 0, run.excerpt()
    (grow,) = run.adjustments()
    assert grow["step"] == 2 and grow["joiners"] == ["w2"] and len(grow["members"]) == 3
    per_epoch = committed_batches(run)
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, counts in per_epoch.items():
        assert counts == Counter(range(TRAIN)), f"epoch {epoch}: not each sample once"
    records = loop_records(run)
    assert sorted(records) == ["w0", "w1", "w2"] and not any(record["left"] for record in records.values())
    for worker, record in records.items():
        assert record["local_sgd_steps"] == STEPS, (worker, record["local_sgd_steps"])  # the joiner's counts on
        assert [evaluation["world"] for evaluation in record["evaluations"]] == [3, 3], worker
        for evaluation in record["evaluations"]:
            assert sorted(evaluation["samples"]) == list(range(VALIDATION)), worker  # each sample once
    parameters = [record["parameters"] for record in records.values()]
    assert all(each == parameters[0] for each in parameters), "the models differ after LocalSGD's last averaging"

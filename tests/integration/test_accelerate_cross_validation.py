"""A loop per cross-validation fold (user loop ``accelerate_cross_validation_loop.py``, after Accelerate's
``by_feature/cross_validation.py``: ``prepare()`` and an ``accelerator.epochs(2)`` loop per fold) under the real
`elan run --nproc 2`. ``epochs()`` continues the job's epochs on its first training DataLoader, and a joiner could not
tell which fold the job is in, so a second training loop is refused, on every worker, with what to do instead.

On the old code the second fold's ``epochs(2)`` yielded no epoch: fold 1 trained nothing, its evaluation scored the
untrained model, and the job ended 0 without a word.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import loop_run

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_cross_validation_loop.py")
SAMPLES, EPOCHS = 32, 2


def test_a_second_training_loop_is_refused_on_every_worker_after_the_first_trained_each_sample(tmp_path):
    run = loop_run(tmp_path, "folds", LOOP)
    assert run.returncode != 0, "the second fold's loop was not refused"
    refusal = "RuntimeError: accelerator.epochs(2) after an earlier epochs() loop ran out"
    assert run.output.count(refusal) == 2, run.excerpt()  # one traceback per worker, both at the second fold
    assert "run each fold as its own `elan run` job" in run.output
    folds = [json.loads(line) for path in sorted(run.out.glob("folds-*.jsonl"))
             for line in path.read_text().splitlines()]
    assert [fold["fold"] for fold in folds] == [0, 0], folds  # the first fold ran to its evaluation, the second never
    trained = Counter(index for fold in folds for index in fold["trained"])
    assert trained == Counter({index: EPOCHS for index in range(1, SAMPLES, 2)})  # fold 0: odd samples, each per epoch
    assert all(sorted(fold["validated"]) == list(range(0, SAMPLES, 2)) for fold in folds)

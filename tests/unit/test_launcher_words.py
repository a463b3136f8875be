"""The launcher's and the autoscaler's log lines read as sentences whose counts agree with their nouns."""

from __future__ import annotations

import logging

import pytest

from lightning_elan.launcher.run import describe_sizing, generations_phrase
from lightning_elan.protocol.contract import (
    AutoscaleReply,
    AutoscaleRequest,
    StragglerSettings,
    StragglersReply,
    StragglersRequest,
)
from lightning_elan.sizing.autoscale import ThroughputAutoscaler, UtilityAutoscaler, UtilityFunction


@pytest.mark.parametrize(("generations", "text"), [
    ([3], "generation 3"),
    ([2, 3], "generations 2 and 3"),
    ([1, 2, 3], "generations 1, 2 and 3"),
])
def test_generations_phrase(generations: list[int], text: str) -> None:
    assert generations_phrase(generations) == text


def test_a_straggler_request_in_words() -> None:
    reply = StragglersReply(StragglerSettings("replace", alpha=0.1, threshold=0.8, window=1))
    assert describe_sizing("x", StragglersRequest("replace"), reply) == (
        "stragglers of job 'x' are replaced: a worker whose throughput stays below 0.8 of the median for 1 round")
    off = StragglersReply(StragglerSettings("off", alpha=0.1, threshold=0.5, window=3))
    assert describe_sizing("x", StragglersRequest("off"), off) == (
        "stragglers of job 'x' are only reported: a worker whose throughput stays below 0.5 of the median for 3 "
        "rounds")


def test_an_autoscale_request_in_words_not_json() -> None:
    reply = AutoscaleReply({"policy": "throughput", "config": {"min_workers": 1, "max_workers": 4, "step": 1,
                                                               "every": 20, "threshold": 0.1}})
    text = describe_sizing("x", AutoscaleRequest("throughput", max_workers=4), reply)
    assert text.startswith("autoscaling of job 'x' is on: throughput policy, 1 to 4 workers, 1 worker a step")
    assert "{" not in text
    assert describe_sizing("x", AutoscaleRequest("off"), AutoscaleReply(None)) == "autoscaling of job 'x' is off"
    growth = describe_sizing("x", AutoscaleRequest("off", scale_out_command="sbatch w.sh"), AutoscaleReply(None))
    assert growth == "autoscaling of job 'x' is off; growth runs 'sbatch w.sh'"


def test_the_throughput_autoscaler_settles_at_1_worker(caplog: pytest.LogCaptureFixture) -> None:
    scaler = ThroughputAutoscaler(step=1, threshold=0.1, min_workers=1)
    rates: dict[int, float] = {}
    current = 2
    with caplog.at_level(logging.INFO, logger="lightning_elan.sizing.autoscale"):
        for rate_at in ({2: 200.0}, {3: 201.0}, {1: 199.0}):
            rates.update(rate_at)
            decision = scaler.decide(current, rates)
            current = decision.target if decision is not None else current
    assert scaler.settle_reason == "settled at 1 worker: 1 worker is the lower limit"
    assert "settled at 1 worker: 1 worker is the lower limit" in caplog.messages
    assert ThroughputAutoscaler(min_workers=2, max_workers=3).decide(1, {1: 10.0}).reason == (
        "1 worker is outside [2, 3]")


def test_the_utility_autoscaler_counts_workers() -> None:
    linear = UtilityFunction.from_dict({"points": [[0, 1000], [1000, 0]]})
    decision = UtilityAutoscaler(0.5, linear).decide(5, {4: 400.0, 5: 450.0}, 100_000, 0.0)
    assert decision.reason.startswith("remove 1 worker, 5 -> 4:")
    assert "(rate at 6 workers estimated" in decision.reason

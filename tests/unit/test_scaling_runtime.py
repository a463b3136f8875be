"""The runtime side of hybrid scaling, without processes: the data position across a change of the global batch, the
protocol fields, the AM's record and status, the ``elan status`` text, and the strategy's scaling link."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from torch.utils.data import DataLoader

from lightning_elan.callbacks import HybridScaling, ProgressiveLinearLR
from lightning_elan.cli_status import format_status
from lightning_elan.data.loader import ElasticDataLoader
from lightning_elan.data.positions import epoch_end_position, epoch_steps, global_batch_size_at, local_share
from lightning_elan.data.sampler import DataPosition
from lightning_elan.elastic.scaling import ScalingLink
from lightning_elan.master.state import JobState
from lightning_elan.master.transitions import adjustments, launching, requests, status_view
from lightning_elan.protocol.contract import AdjustmentReport, CoordinateRequest, RegisterRequest, StatusReply
from lightning_elan.protocol.messages import ProtocolError, validate_body

DECISION = {"global_batch": 24, "local_batch": 6, "k": 2.0, "reason": "weak: global batch x4/2", "lr_scale": 2.0}


# ---------------------------------------------------------------------- data position across a global-batch change


@pytest.mark.parametrize(
    ("samples", "batch", "drop_last", "steps_before", "position_before", "steps", "end"),
    [
        (100, 24, False, 3, 36, 6, 100),  # 3×12, then 24, 24, 16
        (100, 24, True, 3, 36, 5, 84),  # 3×12, then 24, 24 (16 dropped)
        (100, 6, False, 2, 48, 11, 100),  # 2×24, then 9×6 − the last one 4 samples
        (100, 12, False, 0, 0, 9, 100),  # no change
    ],
)
def test_epoch_length_counts_batches_before_and_after_a_change(
    samples, batch, drop_last, steps_before, position_before, steps, end
):
    assert epoch_steps(samples, batch, drop_last, steps_before, position_before) == steps
    assert epoch_end_position(samples, batch, drop_last, position_before) == end


def test_change_global_batch_remembers_where_the_new_size_took_over():
    data = DataPosition(global_batch=12, position=36)
    data.change_global_batch(24)
    assert (data.steps_before, data.position_before, data.steps_done()) == (3, 36, 3)
    data.position = 84
    assert data.steps_done() == 5
    data.change_global_batch(6)
    assert (data.steps_before, data.position_before, data.global_batch) == (5, 84, 6)
    data.change_global_batch(6)  # the same size again: nothing to remember
    assert (data.steps_before, data.position_before) == (5, 84)
    data.start_epoch(1)
    assert (data.epoch, data.position, data.steps_before, data.position_before) == (1, 0, 0, 0)
    with pytest.raises(ValueError, match="global batch"):
        data.change_global_batch(0)


def test_state_without_the_change_fields_still_loads():
    data = DataPosition()
    data.load_state_dict({"epoch": 2, "position": 24, "global_batch": 12})
    assert (data.steps_before, data.position_before) == (0, 0)


def _epoch_with_batch_changes(drop_last: bool, changes: dict[int, tuple[int, int]]) -> tuple[Counter, int, list[int]]:
    """Consume one epoch of 100 samples as the strategy does, changing ``step: (global batch, world size)``; return
    the indices taken, the steps and the loader length seen at every step."""
    data = DataPosition(global_batch=12)
    world = [0, 2]
    user_loader = DataLoader(list(range(100)), batch_size=6, shuffle=True, drop_last=drop_last)
    loaders = {}
    seen: Counter = Counter()
    lengths, step = [], 0
    while data.position < ElasticDataLoader(user_loader, data, lambda: (0, 1), 0).sampler.epoch_end():
        if step in changes:
            batch, world[1] = changes[step]
            data.change_global_batch(batch)
        size = world[1]
        end = ElasticDataLoader(user_loader, data, lambda: (0, 1), 0).sampler.epoch_end()
        global_size = global_batch_size_at(end, data.position, data.global_batch)
        for rank in range(size):
            if (rank, size) not in loaders:
                loaders[rank, size] = ElasticDataLoader(user_loader, data, lambda r=rank, s=size: (r, s), 0)
            loader = loaders[rank, size]
            lengths.append(len(loader))
            batch_indices = next(iter(loader))
            if local_share(data.position, global_size, size, rank).size:
                seen.update(batch_indices.tolist())
        data.position = min(end, data.position + data.global_batch)
        step += 1
    return seen, step, lengths


@pytest.mark.parametrize(
    ("drop_last", "changes", "steps", "used"),
    [
        # 3×12 (36) + 2×24 (84) + 2×6 (96) + 18 from 96: one partial batch of 4
        (False, {3: (24, 4), 5: (6, 1), 7: (18, 3)}, 8, 100),
        # drop_last: 3×12 (36) + 24 (60) + 6×6 (96); the last 4 samples are dropped
        (True, {3: (24, 4), 4: (6, 1)}, 10, 96),
        # drop_last: 3×12 (36) + 2×24 (84): the 16 left are less than a global batch of 24, the epoch ends
        (True, {3: (24, 4)}, 5, 84),
    ],
)
def test_every_sample_at_most_once_and_the_length_is_the_real_step_count_when_the_batch_changes(
    drop_last, changes, steps, used
):
    seen, taken, lengths = _epoch_with_batch_changes(drop_last, changes)
    assert taken == steps
    assert lengths[-1] == steps, "the loader's length is the number of steps the epoch really has"
    assert set(seen.values()) == {1} and len(seen) == used


# ---------------------------------------------------------------------- protocol


def test_report_and_coordinate_carry_validated_scaling_fields():
    validate_body("report", {"worker_id": "w0", "generation": 1, "role": "stayer", "global_batch": 24,
                             "scaling": DECISION})
    summary = {"policy": "hybrid", "model_ready": False, "observations": {}, "world_size": 2, "global_batch": 12,
               "throughput": [{"global_batch": 12, "samples_per_s": {}, "optimal_workers": None}],
               "last_decision": DECISION}
    validate_body("coordinate", {"worker_id": "w0", "generation": 0, "step": 3, "scaling": summary})


@pytest.mark.parametrize(
    ("msg_type", "body", "message"),
    [
        ("report", {"scaling": {**DECISION, "global_batch": "24"}}, "report.scaling: field 'global_batch' must be int"),
        ("report", {"scaling": {**DECISION, "reason": None}}, "report.scaling: missing field 'reason'"),
        ("report", {"scaling": [DECISION]}, "field 'scaling' must be dict"),
        ("report", {"global_batch": 2.5}, "field 'global_batch' must be int"),
        ("coordinate", {"scaling": {"policy": "hybrid"}}, "coordinate.scaling: missing field 'model_ready'"),
        ("coordinate", {"scaling": {"policy": "weak", "model_ready": True, "last_decision": {"k": 1}}},
         "coordinate.scaling.last_decision: missing field 'global_batch'"),
        ("coordinate", {"scaling": {"policy": "weak", "model_ready": 1}}, "field 'model_ready' must be bool"),
    ],
)
def test_malformed_scaling_fields_are_refused(msg_type, body, message):
    base = {"report": {"worker_id": "w0", "generation": 1, "role": "stayer"},
            "coordinate": {"worker_id": "w0", "generation": 0, "step": 3}}[msg_type]
    with pytest.raises(ProtocolError, match=message.replace(".", r"\.")):
        validate_body(msg_type, {**base, **body})


# ---------------------------------------------------------------------- AM: record and status


def _grown_job() -> JobState:
    state = JobState(job="job")
    launching.start_job(state, 2)
    requests.scale(state, "add", count=2)
    for worker in ("w2", "w3"):
        requests.register(state, RegisterRequest(worker, host="host", device="cpu", pid=1))
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 3)).decision == "adjust"
    return state


def test_the_adjustment_record_carries_the_decision_all_members_applied():
    state = _grown_job()
    for worker in ("w0", "w1", "w2"):
        assert adjustments.report(state, AdjustmentReport(worker, 1, "joiner" if worker == "w2" else "stayer",
                                                          global_batch=24, scaling=DECISION)) is None
    record = adjustments.report(state, AdjustmentReport("w3", 1, "joiner", global_batch=24, scaling=DECISION))
    assert record is not None and record["global_batch"] == 24 and record["scaling"] == DECISION
    assert "scaling_mismatch" not in record


def test_members_that_applied_different_batches_are_recorded_as_a_mismatch():
    state = _grown_job()
    for worker, batch in (("w0", 24), ("w1", 24), ("w2", 24)):
        role = "joiner" if worker == "w2" else "stayer"
        adjustments.report(state, AdjustmentReport(worker, 1, role, global_batch=batch, scaling=DECISION))
    record = adjustments.report(state, AdjustmentReport("w3", 1, "joiner", global_batch=12))
    assert record["global_batch"] is None and record["scaling"] is None
    assert record["scaling_mismatch"] == {"w0": 24, "w1": 24, "w2": 24, "w3": 12}


def test_status_keeps_rank0s_last_summary_until_a_new_one_arrives():
    state = JobState(job="job")
    launching.start_job(state, 1)
    summary = {"policy": "weak", "model_ready": False, "last_decision": DECISION}
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 1, scaling=summary))
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 2))  # no summary this time: the last one stays
    assert status_view.status(state).scaling == summary
    restored = JobState.from_dict(state.to_dict())
    assert status_view.status(restored).scaling == summary


def test_elan_status_prints_the_model_and_the_last_decision():
    summary = {
        "policy": "hybrid", "model_ready": True, "world_size": 4, "global_batch": 24,
        "throughput": [
            {"global_batch": 24, "samples_per_s": {"1": 700.0, "2": 900.0, "4": 800.0}, "optimal_workers": 2},
            {"global_batch": 48, "samples_per_s": {"1": 800.0, "2": 1200.0, "4": 1300.0}, "optimal_workers": 4},
        ],
        "last_decision": DECISION,
    }
    record = {"request_id": "r1", "action": "add", "step": 3, "generation": 1, "joiners": ["w2"], "leavers": [],
              "global_batch": 24, "scaling": DECISION}
    text = format_status(StatusReply(job="j", generation=1, members=[], finished=False, scaling=summary,
                                     last_adjustment=record))
    assert "global batch 24 (lr x2.0: weak: global batch x4/2)" in text
    assert "scaling: policy hybrid, throughput model ready" in text
    assert "global batch 48: samples/s by workers {1: 800.0, 2: 1200.0, 4: 1300.0}, best 4" in text
    assert "last decision: global batch 24 (local 6, k=2): weak: global batch x4/2" in text
    assert "scaling:" not in format_status(StatusReply(job="j", generation=0, members=[], finished=False))


# ---------------------------------------------------------------------- the engine's scaling link


class _Trainer(SimpleNamespace):
    """What HybridScaling.apply reads of a Trainer: its callbacks and the next optimizer step."""


def _registered(policy: str = "weak", global_step: int = 3) -> tuple[ScalingLink, _Trainer]:
    scaling, ramp = HybridScaling(policy=policy), ProgressiveLinearLR(ramp_steps=4)
    trainer = _Trainer(callbacks=[scaling, ramp], global_step=global_step)
    scaling._trainer = trainer  # what HybridScaling.setup keeps when Lightning sets it up
    link = ScalingLink(summary_every_s=5.0)
    link.participant = scaling
    return link, trainer


def test_without_a_participant_nothing_is_decided_or_applied():
    link, data = ScalingLink(), DataPosition(global_batch=12, position=36)
    assert link.decide(2, 3, 12) is None
    link.apply(data, DECISION)
    assert data.global_batch == 12 and data.steps_before == 0
    assert link.summary_if_due() is None and link.last_decision() is None


def test_rank0_decides_and_every_rank_applies_the_batch_and_the_ramp():
    decider, _ = _registered()
    decision = decider.decide(2, 4, 12)
    assert decision == DECISION
    for link, trainer in (_registered(), _registered()):
        data = DataPosition(global_batch=12, position=36)
        link.apply(data, decision)
        assert (data.global_batch, data.steps_before, data.position_before) == (24, 3, 36)
        ramp = trainer.callbacks[1]
        assert [ramp.scale_at(step) for step in (3, 5, 7, 9)] == [1.0, 1.5, 2.0, 2.0]
        assert link.last_decision() == DECISION


def test_the_summary_goes_to_the_am_right_after_a_decision_and_then_at_most_every_interval():
    link, _ = _registered()
    assert link.summary_if_due(now=100.0)["policy"] == "weak"
    assert link.summary_if_due(now=103.0) is None
    assert link.summary_if_due(now=105.5) is not None
    link.apply(DataPosition(global_batch=12, position=36), DECISION)
    summary = link.summary_if_due(now=106.0)
    assert summary is not None and summary["last_decision"] == DECISION

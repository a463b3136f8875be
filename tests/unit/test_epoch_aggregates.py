"""Epoch aggregates handed from departed members to the heir: the records' store rules (``elastic/epoch_aggregates``)
and the merge into Lightning's own ``_ResultCollection`` and real torchmetrics (``compat.epoch_aggregates`` /
``absorb_epoch_aggregates``): a process that took another's records computes what one process that trained every
batch computes."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import lightning.pytorch  # noqa: F401  (first: importing Lightning registers the strategy, which imports compat)
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_elan import compat
from lightning_elan.elastic.epoch_aggregates import (
    AggregateHandover,
    AggregateRecord,
    Inheritance,
    heir_of,
    read_records,
    record_key,
    write_record,
)
from lightning_elan.elastic.failures import CommitVote
from lightning_elan.elastic.worker import ElasticWorker
from lightning_elan.protocol.contract import AdjustmentPlan, WorkerEnvironment


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.train_mse = torchmetrics.MeanSquaredError()
        self.train_auroc = torchmetrics.classification.BinaryAUROC()  # a "cat" state (predictions and targets)
        self.local_max = torchmetrics.MaxMetric(sync_on_compute=False)  # each process's own: never merged


def _process() -> SimpleNamespace:
    """What the compat functions read of a trainer: the training epoch loop's results and the LightningModule."""
    results = _ResultCollection(training=True)
    epoch_loop = SimpleNamespace(_results=results)
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=epoch_loop), lightning_module=_Module(), current_epoch=0)


def _train(process: SimpleNamespace, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A ``training_step``'s logging of each batch, as ``LightningModule.log`` hands it to the results."""
    results, module = process.fit_loop.epoch_loop._results, process.lightning_module
    for prediction, target in batches:
        loss = torch.nn.functional.mse_loss(prediction, target)
        results.log("training_step", "train_loss", loss, on_step=True, on_epoch=True, sync_dist=True,
                    batch_size=len(target))
        results.log("training_step", "train_peak", loss, on_epoch=True, reduce_fx="max", sync_dist=True,
                    batch_size=len(target))
        results.log("training_step", "rank_loss", loss, on_epoch=True, batch_size=len(target))  # no sync_dist
        module.train_mse(prediction, target)
        module.train_auroc(prediction.sigmoid(), torch.arange(len(target)) % 2)
        module.local_max(loss)


def _batches(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [3, 5, 4, 2, 6, 1][:count]
    return [(torch.randn(size, dtype=torch.float64, generator=generator),
             torch.randn(size, dtype=torch.float64, generator=generator)) for size in sizes]


def _epoch_values(process: SimpleNamespace) -> dict[str, float]:
    results, module = process.fit_loop.epoch_loop._results, process.lightning_module
    return {"train_loss": float(results["training_step.train_loss"].compute()),
            "train_peak": float(results["training_step.train_peak"].compute()),
            "train_mse": float(module.train_mse.compute()), "train_auroc": float(module.train_auroc.compute())}


def test_a_heir_that_took_a_departed_members_aggregates_computes_the_epoch_of_both() -> None:
    heir, departed, both = _process(), _process(), _process()
    mine, theirs = _batches(1, 4), _batches(2, 3)
    _train(heir, mine)
    _train(departed, theirs)
    _train(both, mine + theirs)
    record = AggregateRecord("w1", 7, 0, compat.epoch_aggregates(departed))
    compat.absorb_epoch_aggregates(heir, [AggregateRecord.from_bytes(record.to_bytes()).aggregates])
    assert _epoch_values(heir) == pytest.approx(_epoch_values(both), rel=1e-12, abs=1e-12)


def test_a_joiner_that_took_the_aggregates_before_logging_adds_them_at_its_first_boundary(
        caplog: pytest.LogCaptureFixture) -> None:
    """A whole migration: the joiner has logged nothing yet when it takes the leaver's aggregates (no
    ``_ResultMetric`` exists for the key), and takes them in ``strategy.setup``, where ``current_epoch`` is still 0
    while the job is in epoch 1; its first batch boundary adds them. A part whose key is never logged in the epoch of
    that boundary is dropped when the epoch ends, with a warning."""
    joiner, departed, both = _process(), _process(), _process()
    before, after = _batches(4, 3), _batches(5, 4)
    _train(departed, before)
    _train(both, before + after)
    compat.absorb_epoch_aggregates(joiner, [compat.epoch_aggregates(departed)])
    joiner.current_epoch = 1  # Lightning restored the joiner's loops
    _train(joiner, after)
    compat.epoch_aggregates(joiner)  # the joiner's first batch boundary
    assert _epoch_values(joiner) == pytest.approx(_epoch_values(both), rel=1e-12, abs=1e-12)
    never = _process()
    compat.absorb_epoch_aggregates(never, [{"logged/training_step.only_on_the_leaver": compat.epoch_aggregates(
        departed)["logged/training_step.train_loss"]}])
    compat.epoch_aggregates(never)  # bound to epoch 0 at this boundary
    never.current_epoch = 1
    with caplog.at_level(logging.WARNING):
        compat.epoch_aggregates(never)
    assert "only_on_the_leaver of a departed member was never logged here in epoch 0" in caplog.text
    assert not never.fit_loop.epoch_loop._elan_pending_aggregates


def test_values_logged_without_sync_dist_and_metrics_that_do_not_sync_stay_each_processs_own() -> None:
    process = _process()
    _train(process, _batches(3, 2))
    keys = set(compat.epoch_aggregates(process))
    assert keys == {"logged/training_step.train_loss", "logged/training_step.train_peak", "metric/train_mse",
                    "metric/train_auroc"}


def test_nothing_is_recorded_before_anything_was_logged() -> None:
    assert compat.epoch_aggregates(_process()) == {}


def test_a_metric_averaged_over_processes_is_left_as_it_is_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    heir, departed = _process(), _process()
    heir.lightning_module.mean_metric = torchmetrics.MeanMetric()
    departed.lightning_module.mean_metric = torchmetrics.MeanMetric()
    heir.lightning_module.mean_metric.add_state("spread", torch.tensor(0.0), dist_reduce_fx="mean")
    departed.lightning_module.mean_metric.add_state("spread", torch.tensor(0.0), dist_reduce_fx="mean")
    heir.lightning_module.mean_metric.update(torch.tensor([1.0, 2.0]))
    departed.lightning_module.mean_metric.update(torch.tensor([5.0]))
    with caplog.at_level(logging.WARNING):
        compat.absorb_epoch_aggregates(heir, [compat.epoch_aggregates(departed)])
    assert float(heir.lightning_module.mean_metric.compute()) == 1.5
    assert "reduces a state by mean" in caplog.text


def _plan(members: list[str], joiners: list[str], previous: list[str], leavers: list[str]) -> AdjustmentPlan:
    return AdjustmentPlan("r1", "remove", 3, 2, 10, members, previous, joiners, leavers, {}, {})


def test_the_heir_is_the_first_stayer_else_the_first_joiner() -> None:
    assert heir_of(_plan(["w2", "w0"], [], ["w0", "w1", "w2"], ["w1"])) == "w2"
    assert heir_of(_plan(["w2", "w3"], ["w3"], ["w0", "w2"], ["w0"])) == "w2"
    assert heir_of(_plan(["w3", "w4"], ["w3", "w4"], ["w0", "w1"], ["w0", "w1"])) == "w3"


def test_records_of_another_epoch_a_later_step_or_none_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    aggregates = {"logged/x": {"states": {"value": torch.tensor(1.0)}, "update_count": 1}}
    write_record(store, 2, AggregateRecord("same", 10, 1, aggregates))
    write_record(store, 2, AggregateRecord("earlier", 9, 1, aggregates))
    write_record(store, 2, AggregateRecord("later", 11, 1, aggregates))
    write_record(store, 2, AggregateRecord("last_epoch", 10, 0, aggregates))
    write_record(store, 1, AggregateRecord("other_generation", 10, 1, aggregates))
    with caplog.at_level(logging.WARNING):
        records = read_records(store, 2, ["same", "earlier", "later", "last_epoch", "other_generation", "absent"],
                               10, 1)
    assert [record.worker_id for record in records] == ["same", "earlier"]
    assert "from step 9, not 10" in caplog.text


def test_a_member_that_died_entering_a_recovery_counts_with_its_record_of_the_generation_before() -> None:
    """Generation 3 failed, the recovery's generation 4 failed as it formed: a member that wrote no record in 4 (it
    died entering it) has its record of 3 read; one that wrote in 4 has that one read, never both."""
    store = dist.HashStore()
    part = {"logged/x": {"states": {"value": torch.tensor(1.0)}, "update_count": 1}}
    write_record(store, 3, AggregateRecord("died_entering", 10, 1, part))
    write_record(store, 3, AggregateRecord("entered", 10, 1, part))
    write_record(store, 4, AggregateRecord("entered", 10, 1, {"logged/x": {"states": {"value": torch.tensor(2.0)},
                                                                           "update_count": 2}}))
    records = read_records(store, 4, ["died_entering", "entered"], 10, 1, earlier=(3,))
    assert [(record.worker_id, record.aggregates["logged/x"]["update_count"]) for record in records] == [
        ("died_entering", 1), ("entered", 2)]
    assert read_records(store, 4, ["died_entering"], 10, 1) == [], "without the earlier generations: nothing"


def test_an_heir_that_died_before_it_recorded_what_it_took_hands_on_the_parts_it_took() -> None:
    """w0, the heir of the plan of generation 4, took w1's part (recorded in 3) and died entering 4 with its own
    record of 3 only (before it took): the next heir reads w0's and w1's records. Had w0 recorded in 4 (with w1's
    part in it), w1's would not be read again."""
    store = dist.HashStore()
    part = {"logged/x": {"states": {"value": torch.tensor(1.0)}, "update_count": 1}}
    write_record(store, 3, AggregateRecord("w0", 10, 1, part))
    write_record(store, 3, AggregateRecord("w1", 10, 1, part))
    inherited = {"w0": [Inheritance(4, ("w1",))]}
    records = read_records(store, 4, ["w0"], 10, 1, earlier=(3,), inherited=inherited)
    assert [record.worker_id for record in records] == ["w0", "w1"]
    write_record(store, 4, AggregateRecord("w0", 10, 1, part))
    records = read_records(store, 4, ["w0"], 10, 1, earlier=(3,), inherited=inherited)
    assert [record.worker_id for record in records] == ["w0"]


def test_a_record_of_the_previous_epochs_last_step_is_left_out_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """A member whose newest record is of epoch 0's end while the heir stands at epoch 1's first step (it died so
    without a record of that step): its part of epoch 1 is lost, and the heir says so; one that died before its step
    stood (the heir at the same step) lost nothing."""
    store = dist.HashStore()
    aggregates = {"logged/x": {"states": {"value": torch.tensor(1.0)}, "update_count": 1}}
    write_record(store, 2, AggregateRecord("died_after_the_step", 9, 0, aggregates))
    with caplog.at_level(logging.WARNING):
        assert read_records(store, 2, ["died_after_the_step"], 10, 1) == []
        assert "from step 9 of epoch 0, not step 10 of epoch 1" in caplog.text
        caplog.clear()
        assert read_records(store, 2, ["died_after_the_step"], 9, 1) == []
    assert caplog.text == ""


def test_a_record_is_read_back_as_the_same_tensors() -> None:
    states = {"preds": [torch.ones(2), torch.zeros(1)], "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
              "strided": torch.arange(6.0, dtype=torch.float64).reshape(2, 3).t(), "count": torch.tensor(3),
              "empty": torch.empty(0, 4)}
    record = AggregateRecord("w0", 3, 2, {"metric/m": {"states": states, "update_count": 2}})
    back = AggregateRecord.from_bytes(record.to_bytes())
    assert (back.worker_id, back.step, back.epoch) == ("w0", 3, 2)
    got = back.aggregates["metric/m"]["states"]
    assert [t.tolist() for t in got["preds"]] == [[1.0, 1.0], [0.0]]
    for name in ("half", "strided", "count", "empty"):
        assert got[name].dtype == states[name].dtype and torch.equal(got[name], states[name]), name
    assert back.aggregates["metric/m"]["update_count"] == 2


def test_garbage_under_a_record_key_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    store.set(record_key(4, "w1"), b"\x07garbage")
    store.set(record_key(4, "w2"), (5).to_bytes(8, "little") + b'{"a":')
    bad_dtype = AggregateRecord("w3", 1, 0, {"k": {"states": {"v": torch.ones(1)}, "update_count": 1}}).to_bytes()
    store.set(record_key(4, "w3", 1), bad_dtype.replace(b'"float32"', b'"Tensor" '))
    with caplog.at_level(logging.WARNING):
        assert read_records(store, 4, ["w1", "w2", "w3"], 1, 0) == []
    assert caplog.text.count("are not a record") == 3


class _Aggregates:
    """The part of a front-end the recording asks: what ``epoch_aggregates`` returns (a user's metric states)."""

    def __init__(self, states: dict[str, Any]) -> None:
        self.states = states

    def epoch_aggregates(self) -> dict[str, Any]:
        return {"metric/custom": {"states": self.states, "update_count": 1}}


def _recording_member(states: dict[str, Any]) -> tuple[ElasticWorker, dist.Store]:
    """A member of generation 0 of one, voting in an in-memory store (no process group is needed to record)."""
    engine = ElasticWorker(WorkerEnvironment.standalone_process())
    engine.attach(_Aggregates(states))  # type: ignore[arg-type]
    store = dist.HashStore()
    engine.generation, engine._vote = 0, CommitVote(store, 0, 0, 1, lambda: False)
    return engine, store


def test_a_metric_state_of_plain_values_is_recorded_and_one_that_cannot_be_stops_the_recording(
        caplog: pytest.LogCaptureFixture) -> None:
    engine, store = _recording_member({"values": [0.5, 1.5], "total": torch.tensor(2.0)})
    engine._record_aggregates(4)
    [record] = read_records(store, 0, ["w0"], 4, engine.data.epoch)
    assert record.aggregates["metric/custom"]["states"]["values"] == [0.5, 1.5]
    engine, store = _recording_member({"seen": [{"a", "set"}]})  # not a tensor, not a JSON value
    with caplog.at_level(logging.WARNING):
        engine._record_aggregates(4)
        engine._record_aggregates(5)
    assert read_records(store, 0, ["w0"], 5, engine.data.epoch) == []
    assert caplog.text.count("stops recording its epoch aggregates") == 1


class _Heir(_Aggregates):
    """A front-end that keeps what it is handed, or refuses it as a broken user metric would."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__({"total": torch.tensor(1.0)})
        self.absorbed: list[list[dict[str, Any]]] = []
        self.refuse = refuse

    def absorb_epoch_aggregates(self, parts: list[dict[str, Any]]) -> None:
        if self.refuse:
            raise TypeError("a metric state of another shape")
        self.absorbed.append(parts)


def test_only_the_heir_takes_the_departed_members_records_and_a_refusal_is_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    AggregateHandover("w2", _Heir()).record(store, 2, 10, 0)  # w2's record in the plan's previous generation
    plan = _plan(["w0", "w1"], [], ["w0", "w1", "w2"], ["w2"])
    heir, other = _Heir(), _Heir()
    AggregateHandover("w1", other).take(plan, ["w2"], store, 10, 0)
    AggregateHandover("w0", heir).take(plan, ["w2"], store, 10, 0)
    assert other.absorbed == [] and len(heir.absorbed) == 1
    assert torch.equal(heir.absorbed[0][0]["metric/custom"]["states"]["total"], torch.tensor(1.0))
    with caplog.at_level(logging.WARNING):
        AggregateHandover("w0", _Heir(refuse=True)).take(plan, ["w2"], store, 10, 0)
    assert "could not add the epoch aggregates of w2" in caplog.text


class _Counting:
    """A store that counts its writes (a record equal to the one in its slot is not written again)."""

    def __init__(self) -> None:
        self.store, self.sets = dist.HashStore(), 0

    def set(self, key: str, value: bytes) -> None:
        self.sets += 1
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        return self.store.get(key)


def _totals(records: list[AggregateRecord]) -> list[float]:
    return [float(record.aggregates["metric/custom"]["states"]["total"]) for record in records]


def test_a_member_dying_after_its_step_stood_or_before_it_leaves_the_record_of_the_step_that_stands(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before its vote on step 11 a member records its aggregates with that step's beside its record of step 10: the
    heir takes the record of step 11 when the step stood (the member died in ``on_train_batch_end``, before its
    boundary) and that of step 10 when it was discarded, without a warning. At the boundary the record of step 11 is
    not written again, and the next vote keeps it."""
    store, front = _Counting(), _Aggregates({"total": torch.tensor(1.0)})
    member = AggregateHandover("w1", front)  # type: ignore[arg-type]
    member.record(store, 3, 10, 0)  # store: a dist.Store's set/check/get
    front.states = {"total": torch.tensor(3.0)}
    member.record_before_vote(store, 3, 11, 0)
    with caplog.at_level(logging.WARNING):
        assert _totals(read_records(store, 3, ["w1"], 11, 0)) == [3.0]
        assert _totals(read_records(store, 3, ["w1"], 10, 0)) == [1.0]
    assert caplog.text == "" and store.sets == 2
    member.record(store, 3, 11, 0)
    assert store.sets == 2
    front.states = {"total": torch.tensor(6.0)}
    member.record_before_vote(store, 3, 12, 0)
    assert _totals(read_records(store, 3, ["w1"], 11, 0)) == [3.0]
    assert _totals(read_records(store, 3, ["w1"], 12, 0)) == [6.0]


def test_a_member_that_logs_after_its_vote_marks_its_records_before_a_vote_partial(
        caplog: pytest.LogCaptureFixture) -> None:
    """Its aggregates grew between a vote and the step's boundary (a value logged in ``on_train_batch_end``): a later
    record written before a vote may lack such values, and the heir taking it says so; a boundary's record is whole."""
    front = _Aggregates({"total": torch.tensor(1.0)})
    member, store = AggregateHandover("w1", front), dist.HashStore()  # type: ignore[arg-type]
    member.record(store, 0, 4, 0)
    member.record_before_vote(store, 0, 5, 0)
    front.states = {"total": torch.tensor(2.0)}  # logged after the vote
    member.record(store, 0, 5, 0)
    member.record_before_vote(store, 0, 6, 0)
    with caplog.at_level(logging.WARNING):
        [whole] = read_records(store, 0, ["w1"], 5, 0)
        assert not whole.partial and _totals([whole]) == [2.0]
        assert caplog.text == ""
        [partial] = read_records(store, 0, ["w1"], 6, 0)
    assert partial.partial
    assert "from before its step 6 stood" in caplog.text


def test_a_record_before_a_vote_of_an_epochs_first_step_is_taken_in_that_epoch() -> None:
    """A member that died in epoch 1's first batch after its step stood: its record of that step is epoch 1's; had
    the step been discarded, its record of epoch 0's last step gives nothing to epoch 1, silently."""
    front = _Aggregates({"total": torch.tensor(5.0)})
    member, store = AggregateHandover("w1", front), dist.HashStore()  # type: ignore[arg-type]
    member.record(store, 1, 6, 0)
    front.states = {"total": torch.tensor(0.5)}  # the epoch's results were reset; its first step logged
    member.record_before_vote(store, 1, 7, 1)
    assert _totals(read_records(store, 1, ["w1"], 7, 1)) == [0.5]
    assert read_records(store, 1, ["w1"], 6, 1) == []


def test_a_store_that_fails_before_the_vote_is_left_to_the_vote() -> None:
    class _Dead:
        def set(self, key: str, value: bytes) -> None:
            raise RuntimeError("Connection reset by peer")

    member = AggregateHandover("w1", _Aggregates({"total": torch.tensor(1.0)}))  # type: ignore[arg-type]
    member.record_before_vote(_Dead(), 2, 1, 0)  # type: ignore[arg-type]


def test_a_member_records_its_step_on_entering_a_generation_and_before_each_vote() -> None:
    """The engine: a member that entered generation 1 at step 3 has a record there before it trains (it may die in
    the generation's first step), and one of step 4 before its vote on it."""
    engine, store = _recording_member({"total": torch.tensor(1.0)})
    engine._in_training_loop = True
    plan = AdjustmentPlan("r1", "add", 1, 2, 3, ["w0", "w1"], ["w0"], ["w1"], [], {}, {})
    engine._group = lambda: SimpleNamespace(configure=lambda *args: None, rank=lambda: 0, size=lambda: 1,  # type: ignore[method-assign]
                                            store=store)
    engine._generation_formed = lambda: setattr(engine, "generation", 1)  # type: ignore[method-assign]
    engine.frontend.membership_changed = lambda previous: None  # type: ignore[attr-defined]
    engine._enter(plan)
    assert [record.step for record in read_records(store, 1, ["w0"], 3, engine.data.epoch)] == [3]
    engine._vote = CommitVote(store, 1, 0, 1, lambda: False)
    engine.commit_step(3)
    assert [record.step for record in read_records(store, 1, ["w0"], 4, engine.data.epoch)] == [4]

"""The AM's side of a worker's death (``worker_exit`` → ``recover`` → recovery plan, in
``master/transitions/recovering.py``), in milliseconds."""

from __future__ import annotations

import json

import pytest

from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.transitions import adjustments, launching, recovering, requests, status_view
from lightning_elan.protocol.contract import (
    ACTION_FAILURE,
    AdjustmentReport,
    CoordinateRequest,
    RecoverRequest,
    RegisterRequest,
    WaitPlanReply,
    WorkerExitReply,
)
from tests.unit.am_steps import commit, decide, exited, ready


def started(nproc: int = 3, **policy: object) -> JobState:
    state = JobState(job="job")
    launching.start_job(state, nproc, coordinate_every=1, **policy)
    return state


def check_in(state: JobState, worker: str, generation: int = 0, step: int | None = 7) -> dict:
    return recovering.recover(state, RecoverRequest(worker, generation, has_state=step is not None, step=step))


def test_a_dead_member_starts_a_recovery_of_its_generation() -> None:
    state = started(3)

    reply = exited(state, "w1", -9)

    assert reply == WorkerExitReply(False, recovering=True, failed_generations=[0])
    status = status_view.status(state)
    assert status.recovery["dead"] == ["w1"] and status.recovery["survivors"] == ["w0", "w2"]
    assert status.failures[-1]["kind"] == "worker" and status.failures[-1]["worker_id"] == "w1"
    assert adjustments.coordinate(state, CoordinateRequest("w0", 0, 8)).plan is None  # no planned adjustment meanwhile
    with pytest.raises(StateError, match="recovering from the death of w1"):
        requests.scale(state, "add", count=1)


def test_the_recovery_plan_forms_once_every_survivor_checked_in() -> None:
    state = started(3)
    exited(state, "w1", -9)

    assert check_in(state, "w2") == WaitPlanReply.wait()
    assert adjustments.wait_plan(state, "w2") is None
    reply = check_in(state, "w0")

    plan = adjustments.wait_plan(state, "w2").plan
    assert reply.status == "plan" and plan is not None
    assert (plan.action, plan.generation, plan.members, plan.joiners, plan.step) == (ACTION_FAILURE, 1, ["w0", "w2"],
                                                                                     [], 7)
    adjustments.report(state, AdjustmentReport("w0", 1, "stayer", pause_s=0.1, step=8))
    record = adjustments.report(state, AdjustmentReport("w2", 1, "stayer", pause_s=0.1, step=8))
    assert record is not None and record["action"] == "failure"
    assert record["failure"]["dead"] == ["w1"] and record["failure"]["step_redone"] == 8
    assert state.member_ids == ["w0", "w2"] and state.generation == 1
    assert adjustments.wait_plan(state, "w1").status == "cancelled"


def test_an_adjustment_a_death_cut_short_is_recorded_before_the_recovery() -> None:
    """The migration's joiner dies before it reports the migration: the survivor's recovery report replaces its own,
    so the migration completes with the reports it has (w3's missing), and its record precedes the recovery's."""
    state = started(2)
    requests.scale(state, "migrate", count=1)
    ready(state, "w2")
    plan = decide(state, step=9)
    commit(state, plan)
    adjustments.report(state, AdjustmentReport("w1", 1, "leaver", pause_s=0.0))
    assert adjustments.report_completing(state, AdjustmentReport("w0", 1, "stayer", pause_s=0.2, step=10)) == []
    exited(state, "w2", -9)
    check_in(state, "w0", generation=1, step=11)

    records = adjustments.report_completing(state, AdjustmentReport("w0", 2, "stayer", pause_s=0.1, step=12))

    assert [(r["action"], r["generation"], r.get("unreported")) for r in records] == [("migrate", 1, ["w2"]),
                                                                                      ("failure", 2, None)]
    assert records[0]["pause_s"] == {"w0": 0.2} and records[0]["joiner_startup_s"] == {"w2": None}
    assert state.completing == [] and state.last_adjustment == records[1]


def uncertain_check_in(state: JobState, worker: str, step: int) -> dict:
    return recovering.recover(state, RecoverRequest(worker, 0, has_state=True, step=step, uncertain=True))


@pytest.mark.parametrize(("certain_step", "newest"), [(8, 8), (7, 7)], ids=["another-applied", "nobody-applied"])
def test_an_uncertain_survivor_takes_the_decision_of_the_others(certain_step: int, newest: int) -> None:
    """w1 voted on step 8 and lost the vote's store before reading the decision: w2 applied step 8 (or not)."""
    state = started(3)
    exited(state, "w0", -9)  # rank 0: the fast store's host

    uncertain_check_in(state, "w1", step=7)
    check_in(state, "w2", step=certain_step)

    plan = adjustments.wait_plan(state, "w1").plan
    assert plan is not None and plan.step == newest
    assert (plan.members, plan.joiners) == (["w1", "w2"], [])  # both hold the state at the newest step


def test_survivors_all_uncertain_discard_the_step() -> None:
    state = started(3)
    exited(state, "w0", -9)
    uncertain_check_in(state, "w1", step=7)
    uncertain_check_in(state, "w2", step=7)

    plan = adjustments.wait_plan(state, "w2").plan
    assert plan is not None and (plan.step, plan.members, plan.joiners) == (7, ["w1", "w2"], [])


def test_an_uncertain_check_in_round_trips_through_the_wire_and_the_state_file() -> None:
    request = RecoverRequest("w1", 0, has_state=True, step=7, uncertain=True)
    assert RecoverRequest.from_body(json.loads(json.dumps(request.to_body()))) == request
    state = started(3)
    exited(state, "w0", -9)
    uncertain_check_in(state, "w1", step=7)
    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))
    check_in(restored, "w2", step=8)
    assert adjustments.wait_plan(restored, "w1").plan.step == 8


def test_a_joiner_of_the_interrupted_plan_survives_without_state_and_is_served() -> None:
    state = started(2)
    new = requests.scale(state, "add", count=1).new_workers
    requests.register(state, RegisterRequest(new[0], host="h", device="cpu", pid=1))
    interrupted = adjustments.coordinate(state, CoordinateRequest("w0", 0, 4)).plan
    assert interrupted is not None and interrupted.generation == 1

    reply = exited(state, "w1", -9)

    assert reply.failed_generations == [0, 1]
    check_in(state, "w0", generation=1, step=4)
    check_in(state, "w2", generation=1, step=None)
    plan = adjustments.wait_plan(state, "w0").plan
    assert plan.generation == 2 and plan.members == ["w0", "w2"] and plan.joiners == ["w2"]
    assert plan.sources == {"w2": "w0"}
    assert any(f.get("request_id") == interrupted.request_id for f in status_view.status(state).failures)


def test_the_recovery_plan_names_the_members_of_each_failed_generation() -> None:
    """A death in the broadcast of a resize's plan: a member that never learned of the plan holds its shards in its
    own generation's layout, which the recovery plan names beside the interrupted plan's (``layouts``)."""
    state = started(2)
    new = requests.scale(state, "add", count=1).new_workers
    requests.register(state, RegisterRequest(new[0], host="h", device="cpu", pid=1))
    adjustments.coordinate(state, CoordinateRequest("w0", 0, 4))
    exited(state, "w1", -9)
    check_in(state, "w0", generation=0, step=4)
    check_in(state, "w2", generation=1, step=None)

    plan = adjustments.wait_plan(state, "w0").plan

    assert plan.previous_members == ["w0", "w1", "w2"]  # the interrupted plan's generation, the newest failed
    assert plan.layouts == {"0": ["w0", "w1"], "1": ["w0", "w1", "w2"]}
    assert type(plan).from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_survivor_that_never_checks_in_is_declared_dead() -> None:
    state = started(3)
    ready(state, "w0", "w1", "w2")  # started: a silent one is hung (one still starting: test_am_recovering.py)
    exited(state, "w1", -9)
    check_in(state, "w0")
    deadline = state.recovery.deadline

    poll = launching.launcher_poll(state, now=deadline + 1)

    assert (poll.stop, poll.kill) == ([], ["w2"])  # hung or frozen: SIGKILL (a SIGTERM would wait for it too)
    assert adjustments.wait_plan(state, "w0").plan.members == ["w0"]


def test_the_job_fails_when_every_member_died() -> None:
    state = started(2)
    exited(state, "w0", -9)

    assert exited(state, "w1", -9) == WorkerExitReply(False, recovering=False)
    assert state.finished and "every worker" in status_view.status(state).failed_reason


def test_replace_failed_queues_one_joiner_per_dead_member() -> None:
    state = started(3, replace_failed=True)

    exited(state, "w2", -9)

    assert [request["action"] for request in status_view.status(state).pending] == ["add"]
    assert launching.launcher_poll(state).spawn[0].worker_id == "w3"


def test_below_min_workers_the_recovery_waits_for_a_ready_joiner() -> None:
    state = started(2, replace_failed=True, min_workers=2, join_timeout_s=30)
    exited(state, "w1", -9)
    check_in(state, "w0")
    assert adjustments.wait_plan(state, "w0") is None  # one survivor, two needed
    launching.launcher_poll(state)
    requests.register(state, RegisterRequest("w2", host="h", device="cpu", pid=2))

    launching.launcher_poll(state)  # the launcher's periodic poll notices the ready joiner

    plan = adjustments.wait_plan(state, "w0").plan
    assert plan.members == ["w0", "w2"] and plan.joiners == ["w2"]


def test_below_min_workers_survivors_before_their_loop_go_on_without_a_joiner() -> None:
    """A survivor not in its training loop yet (a death in a collective before it) forms the recovery alone: a joiner
    admitted there would receive a state not set up yet; the replacement stays queued for the first batch boundary."""
    state = started(2, replace_failed=True, min_workers=2, join_timeout_s=30)
    exited(state, "w1", -9)

    recovering.recover(state, RecoverRequest("w0", 0, has_state=True, step=0, before_loop=True))

    plan = adjustments.wait_plan(state, "w0").plan
    assert plan.members == ["w0"] and plan.joiners == []
    assert [request["action"] for request in status_view.status(state).pending] == ["add"]


def test_below_min_workers_the_job_fails_after_the_join_timeout() -> None:
    state = started(2, min_workers=2, join_timeout_s=5)
    exited(state, "w1", -9)
    detected = state.recovery.detected_at

    check_in(state, "w0")
    launching.launcher_poll(state, now=detected + 6)

    assert state.finished and "--min-workers 2" in status_view.status(state).failed_reason
    assert adjustments.wait_plan(state, "w0").status == "cancelled"


def test_recover_refuses_a_generation_that_did_not_fail() -> None:
    state = started(2)

    with pytest.raises(StateError, match="has not failed"):
        check_in(state, "w0")


def test_a_recovery_in_progress_survives_a_json_round_trip() -> None:
    state = started(3)
    exited(state, "w1", -9)
    check_in(state, "w0")

    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))

    check_in(restored, "w2")
    assert adjustments.wait_plan(restored, "w2").plan.members == ["w0", "w2"]


def test_a_death_after_a_member_finished_training_ends_the_job_normally() -> None:
    state = started(3)
    assert exited(state, "w0", 0) == WorkerExitReply(False)  # fit() returned on w0: training is complete

    assert exited(state, "w2", -6) == WorkerExitReply(True)
    assert state.recovery is None and not state.finished


def test_a_ready_joiner_stays_queued_while_more_are_needed() -> None:
    state = started(3, replace_failed=True, min_workers=3, join_timeout_s=30)
    exited(state, "w1", -9)
    exited(state, "w2", -9)
    check_in(state, "w0")
    launching.launcher_poll(state)
    # one of the two replacements is ready
    requests.register(state, RegisterRequest("w3", host="h", device="cpu", pid=3))

    launching.launcher_poll(state)

    assert adjustments.wait_plan(state, "w0") is None
    assert [request["new_workers"] for request in status_view.status(state).pending] == [["w3"], ["w4"]]


def test_the_join_timeout_holds_even_when_a_survivor_never_checks_in() -> None:
    state = started(3, min_workers=3, join_timeout_s=5)
    exited(state, "w1", -9)

    launching.launcher_poll(state, now=state.recovery.detected_at + 6)

    assert state.finished and "--min-workers 3" in status_view.status(state).failed_reason


def test_a_death_while_the_recovery_plan_is_in_flight_waits_only_for_the_living() -> None:
    """w1 died, the recovery plan (w0, w2) is formed, and w2 dies before it reported: the new recovery waits for w0
    only — not for w1, a member of the failed generation 0 that died first (it waited the whole check-in deadline)."""
    state = started(3)
    exited(state, "w1", -9)
    check_in(state, "w0")
    check_in(state, "w2")

    reply = exited(state, "w2", -9)

    assert reply.recovering and reply.failed_generations == [0, 1]
    assert status_view.status(state).recovery["survivors"] == ["w0"]
    check_in(state, "w0", generation=1)
    plan = adjustments.wait_plan(state, "w0").plan
    assert plan is not None and plan.members == ["w0"] and plan.generation == 2
    record = adjustments.report(state, AdjustmentReport("w0", 2, "stayer", pause_s=0.1, step=8))
    assert record is not None and record["failure"]["dead"] == ["w1", "w2"]  # the plan recovers from both deaths


def _replacement_dies_in_its_join(state: JobState, replacement: str, step: int) -> None:
    """``replacement`` registers, the recovery (or the add) takes it in, and it dies before its generation trained."""
    ready(state, replacement)
    if state.recovery is not None:
        for survivor in state.recovery.survivors:
            check_in(state, survivor, state.generation, step)
    else:
        decide(state, step)
    exited(state, replacement, 1)


def test_replace_failed_stops_after_three_replacements_in_a_row_die_in_their_join() -> None:
    """A joiner that cannot join (its script fails loading the job's state) would be replaced for ever, each time at
    the price of a recovery: after 3 replacements in a row died before they trained, no fourth is queued and an error
    record says so; the job trains on with its members."""
    state = started(3, replace_failed=True)
    exited(state, "w2", -9)
    for step, replacement in zip((7, 8, 9), ("w3", "w4", "w5"), strict=True):
        check_in(state, "w0", state.generation, step)
        check_in(state, "w1", state.generation, step)
        commit(state, adjustments.wait_plan(state, "w0").plan, step + 1)
        launching.launcher_poll(state)
        _replacement_dies_in_its_join(state, replacement, step + 1)

    assert [request["action"] for request in status_view.status(state).pending] == []
    assert status_view.status(state).failures[-1]["kind"] == "replacement"
    assert not state.finished and state.recovery is not None and state.recovery.survivors == ["w0", "w1"]


def test_a_replacement_that_trained_starts_the_count_again() -> None:
    state = started(2, replace_failed=True)
    exited(state, "w1", -9)
    check_in(state, "w0", 0, 5)
    commit(state, adjustments.wait_plan(state, "w0").plan, 6)
    launching.launcher_poll(state)
    ready(state, "w2")
    commit(state, decide(state, 7), 8)  # w2 joined and trained
    assert state.unjoined_replacements == {}

    exited(state, "w2", -9)

    assert [request["new_workers"] for request in status_view.status(state).pending] == [["w3"]]
    assert state.unjoined_replacements == {"w3": 1}
    restored = JobState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored.unjoined_replacements == {"w3": 1}


def _scale_in_decided(live_reshard: bool, **policy: object) -> JobState:
    """2 members grown to 3 (w2 joins), then one removed (w2 leaves): rank 0 coordinates with ``live_reshard`` and
    the AM decides the plan."""
    state = started(2, **policy)
    requests.scale(state, "add", count=1)
    ready(state, "w2")
    commit(state, decide(state, step=2), step=3)
    requests.scale(state, "remove", count=1)
    reply = adjustments.coordinate(state, CoordinateRequest("w0", 1, 4, live_reshard=live_reshard or None))
    assert reply.plan is not None and reply.plan.leavers == ["w2"]
    return state


def test_a_leaver_killed_in_a_live_reshard_fails_the_plan() -> None:
    """elan_fsdp: the leaver's rows go to the stayers in the live reshard; its death before it reported fails the plan
    (the stayers recover from the old layout) and, a leaver, it is not replaced under --replace-failed."""
    state = _scale_in_decided(True, replace_failed=True)

    reply = exited(state, "w2", -9)

    assert reply == WorkerExitReply(False, recovering=True, failed_generations=[1, 2])
    recovery = status_view.status(state).recovery
    assert recovery["dead"] == ["w2"] and recovery["survivors"] == ["w0", "w1"]
    assert not state.pending
    check_in(state, "w0", generation=1)
    check_in(state, "w1", generation=1)
    plan = adjustments.wait_plan(state, "w0").plan
    assert plan is not None and (plan.action, plan.members, plan.previous_members) == (ACTION_FAILURE, ["w0", "w1"],
                                                                                       ["w0", "w1"])


def test_a_leaver_killed_after_it_reported_or_without_a_live_reshard_is_gone() -> None:
    """A leaver that reported (its reshard committed), or whose members hold no shard, is not needed: its death is
    not a failure."""
    reported = _scale_in_decided(True)
    adjustments.report(reported, AdjustmentReport("w2", 2, "leaver", pause_s=0.0))
    unsharded = _scale_in_decided(False)

    for state in (reported, unsharded):
        assert exited(state, "w2", -9) == WorkerExitReply(False, left=True)
        assert state.recovery is None


def test_a_stayer_killed_in_a_live_reshard_keeps_the_living_leaver_in_the_recovery_plan() -> None:
    """elan_fsdp, 3 -> 2 (w2 leaves) and w1 dies in the reshard: the living leaver still holds its shard (and w1's
    mirror) of the old layout, so the recovery plan lists it as a leaver (not a member, not waited for); its report
    completes the plan with the survivor's."""
    state = _scale_in_decided(True)

    exited(state, "w1", -9)
    assert state.recovery is not None and state.recovery.leavers == ["w2"]
    assert check_in(state, "w2", generation=2).status == "wait"  # not a survivor: its check-in only waits
    assert adjustments.wait_plan(state, "w2") is None  # not the plan it joined by (w2 joined in generation 0's)
    check_in(state, "w0", generation=1)

    plan = adjustments.wait_plan(state, "w2").plan
    assert plan is not None and (plan.members, plan.leavers) == (["w0"], ["w2"])
    adjustments.report(state, AdjustmentReport("w2", plan.generation, "leaver", pause_s=0.0))
    record = adjustments.report(state, AdjustmentReport("w0", plan.generation, "stayer", pause_s=0.1, step=5))
    assert record is not None and record["action"] == ACTION_FAILURE and record["leavers"] == ["w2"]
    assert state.member_ids == ["w0"] and "w2" in state.left_workers


def test_a_stayers_death_before_an_unsharded_leaver_learned_of_its_plan_lets_the_leaver_go() -> None:
    """DDP, 3 -> 2 (w2 leaves) and w1 dies before anyone read the plan (in its agreement's broadcast): the survivors
    recover without w2, which has left — its ``recover`` is answered so, during the recovery and after it (it had
    waited for a plan that never listed it, or been refused with "generation 1 has not failed") — and the recovery's
    heir takes its epoch aggregates (it is one of the plan's ``previous_members``)."""
    state = _scale_in_decided(False)

    exited(state, "w1", -9)
    assert state.recovery is not None and state.recovery.survivors == ["w0"] and "w2" in state.left_workers
    assert check_in(state, "w2", generation=1) == WaitPlanReply.cancelled("worker w2 has left the job")
    check_in(state, "w0", generation=1)
    plan = adjustments.wait_plan(state, "w0").plan
    assert plan is not None and (plan.members, plan.previous_members) == (["w0"], ["w0", "w1", "w2"])
    adjustments.report(state, AdjustmentReport("w0", plan.generation, "stayer", pause_s=0.1, step=5))

    assert check_in(state, "w2", generation=1) == WaitPlanReply.cancelled("worker w2 has left the job")
    assert exited(state, "w2", 0) == WorkerExitReply(True)
    assert state.member_ids == ["w0"]


def test_a_leaver_that_dies_before_the_recovery_plan_forms_leaves_it_and_is_not_replaced() -> None:
    state = _scale_in_decided(True, replace_failed=True)
    exited(state, "w1", -9)
    pending = list(state.pending)

    exited(state, "w2", -9)
    check_in(state, "w0", generation=1)

    plan = adjustments.wait_plan(state, "w0").plan
    assert plan is not None and (plan.members, plan.leavers) == (["w0"], [])
    assert len(state.pending) == len(pending)  # w1's replacement only


def test_a_leaver_of_a_live_reshard_that_exits_0_before_it_reported_fails_the_plan() -> None:
    """Its rows never reached the stayers (it left without its part of the reshard): they must not wait for it."""
    state = _scale_in_decided(True)

    assert exited(state, "w2", 0) == WorkerExitReply(False, recovering=True, failed_generations=[1, 2])

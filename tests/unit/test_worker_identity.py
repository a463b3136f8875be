import pytest

from lightning_elan.strategy.identity import WorkerIdentity
from lightning_elan.strategy.timeline import StepTimeline


def test_identity_standalone_without_launcher():
    identity = WorkerIdentity.from_env({})
    assert identity.standalone and identity.world_size == 1 and identity.rank == 0


def test_identity_of_a_member_and_a_joiner():
    base = {"ELAN_AM_ADDRESS": "tcp://127.0.0.1:1", "ELAN_STORE_ADDRESS": "127.0.0.1:2", "ELAN_JOB": "j",
            "ELAN_WORKER_ID": "w3", "ELAN_COORDINATE_EVERY": "4", "ELAN_SPAWN_TIME": "12.5"}
    member = WorkerIdentity.from_env({**base, "ELAN_ROLE": "member", "ELAN_RANK": "1", "ELAN_WORLD_SIZE": "2",
                                      "ELAN_GENERATION": "0"})
    assert (member.rank, member.world_size, member.coordinate_every, member.joiner) == (1, 2, 4, False)
    joiner = WorkerIdentity.from_env({**base, "ELAN_ROLE": "joiner"})
    assert joiner.joiner and joiner.spawn_time == 12.5
    with pytest.raises(ValueError, match="ELAN_ROLE"):
        WorkerIdentity.from_env({**base, "ELAN_ROLE": "boss"})


def test_timeline_pause_is_the_extra_time_of_the_step_after_an_adjustment():
    timeline = StepTimeline()
    for t in (0.0, 1.0, 2.0, 3.0):
        assert timeline.step_ended(t) is None
    timeline.adjustment_started()
    assert timeline.step_ended(5.5) == pytest.approx(1.5)
    assert timeline.step_ended(6.5) is None

"""The worker side of the launcher → worker environment contract (``protocol.contract.WorkerEnvironment``)."""

from __future__ import annotations

import pytest

from lightning_elan.protocol.contract import (
    DEFAULT_COORDINATE_EVERY,
    WORKER_ENV_VARS,
    WorkerEnvironment,
    split_host_port,
)

BASE = {"ELAN_AM_ADDRESS": "tcp://127.0.0.1:1", "ELAN_STORE_ADDRESS": "127.0.0.1:2", "ELAN_JOB": "j",
        "ELAN_WORKER_ID": "w3", "ELAN_COORDINATE_EVERY": "4", "ELAN_SPAWN_TIME": "12.5"}


def launched(role: str, **overrides: object) -> WorkerEnvironment:
    arguments = {"job": "j", "worker_id": "w3", "role": role, "am_address": "tcp://127.0.0.1:1",
                 "store_address": "127.0.0.1:2", "coordinate_every": 4, "spawn_time": 1712345678.123456}
    return WorkerEnvironment.launched(**{**arguments, **overrides})  # type: ignore[arg-type]


def test_standalone_without_launcher() -> None:
    environment = WorkerEnvironment.from_env({"ELAN_COORDINATE_EVERY": "3"})

    assert environment.standalone and not environment.joiner
    assert (environment.rank, environment.world_size, environment.am_address) == (0, 1, None)
    assert environment.coordinate_every == 3
    assert WorkerEnvironment.from_env({}).coordinate_every == DEFAULT_COORDINATE_EVERY
    with pytest.raises(ValueError, match="only a launched member or joiner"):
        environment.to_env()


def test_member_and_joiner_read_from_the_launchers_variables() -> None:
    member = WorkerEnvironment.from_env({**BASE, "ELAN_ROLE": "member", "ELAN_RANK": "1", "ELAN_WORLD_SIZE": "2",
                                         "ELAN_GENERATION": "0", "ELAN_DEVICE_INDEX": "1"})
    joiner = WorkerEnvironment.from_env({**BASE, "ELAN_ROLE": "joiner"})

    assert (member.role, member.rank, member.world_size, member.generation) == ("member", 1, 2, 0)
    assert (member.coordinate_every, member.spawn_time, member.device_index) == (4, 12.5, 1)
    assert joiner.joiner
    assert (joiner.rank, joiner.world_size, joiner.generation, joiner.device_index) == (-1, 0, -1, None)


def test_term_grace_defaults_to_30_s_and_must_be_positive() -> None:
    assert WorkerEnvironment.from_env({**BASE, "ELAN_ROLE": "joiner"}).term_grace_s == 30.0
    assert WorkerEnvironment.from_env({**BASE, "ELAN_TERM_GRACE": "2.5"}).term_grace_s == 2.5
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="ELAN_TERM_GRACE must be a number of seconds > 0"):
            WorkerEnvironment.from_env({**BASE, "ELAN_TERM_GRACE": bad})


def test_a_bad_role_is_refused() -> None:
    with pytest.raises(ValueError, match="ELAN_ROLE must be 'member' or 'joiner', got 'boss'"):
        WorkerEnvironment.from_env({**BASE, "ELAN_ROLE": "boss"})


@pytest.mark.parametrize(
    "environment",
    [
        launched("member", rank=2, world_size=3, device_index=0),
        launched("joiner"),
        launched("joiner", term_grace_s=7.5),
        launched("joiner", launch_world_size=3),
    ],
    ids=["member", "joiner", "term-grace", "joiner-told-the-launch-world"],
)
def test_to_env_round_trips_through_from_env(environment: WorkerEnvironment) -> None:
    env = environment.to_env()

    assert WorkerEnvironment.from_env(env) == environment
    assert set(env) <= set(WORKER_ENV_VARS)  # the launcher strips exactly what it may set
    assert all(isinstance(value, str) for value in env.values())


def test_a_joiners_environment_carries_no_rank_and_a_member_carries_generation_zero() -> None:
    joiner, member = launched("joiner").to_env(), launched("member", rank=0, world_size=2).to_env()

    assert {"ELAN_RANK", "ELAN_WORLD_SIZE", "ELAN_GENERATION", "ELAN_DEVICE_INDEX"}.isdisjoint(joiner)
    assert (member["ELAN_GENERATION"], member["ELAN_RANK"], member["ELAN_WORLD_SIZE"]) == ("0", "0", "2")


def test_a_joiner_told_the_launch_world_reads_it_and_one_not_told_reads_zero() -> None:
    told = WorkerEnvironment.from_env({**BASE, "ELAN_ROLE": "joiner", "ELAN_LAUNCH_WORLD_SIZE": "3"})

    assert (told.world_size, told.launch_world_size) == (0, 3)  # no world of its own until its plan
    assert WorkerEnvironment.from_env({**BASE, "ELAN_ROLE": "joiner"}).launch_world_size == 0
    assert "ELAN_LAUNCH_WORLD_SIZE" not in launched("joiner").to_env()


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert split_host_port("::1:80") == ("::1", 80)


def test_elan_worker_under_srun_hands_its_command_elans_world_not_slurms() -> None:
    """srun's task geometry (SLURM_NTASKS…) would make Lightning's SLURMEnvironment claim the process for a fixed-size
    step; the job's and the allocation's identity (SLURM_JOB_ID) stay."""
    from lightning_elan.launcher.enrolled import EnrolledWorker, WorkerConfig
    from lightning_elan.protocol.contract import EnrolReply

    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42", "PATH": "/bin"}
    worker = EnrolledWorker(WorkerConfig("tcp://127.0.0.1:29400", "j", ["true"]), base_env=slurm)
    try:
        env = worker._command_env(EnrolReply("w1", "member", generation=0, rank=1, world_size=2, store_port=5))
    finally:
        worker._client.close()

    assert {"SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"}.isdisjoint(env)
    assert (env["SLURM_JOB_ID"], env["PATH"], env["ELAN_RANK"], env["ELAN_WORLD_SIZE"]) == ("42", "/bin", "1", "2")

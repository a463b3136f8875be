"""A process another launcher started as one of several (torchrun, ``accelerate launch``, ``srun -n``) is refused:
without ``elan run`` each would train alone on the whole dataset (tried: two processes of ``torchrun --nproc_per_node
2`` each trained all 160 steps as rank 0, and both wrote the logs)."""

from __future__ import annotations

import pytest

from lightning_elan.protocol.contract import WorkerEnvironment


@pytest.mark.parametrize("name", ["WORLD_SIZE", "SLURM_STEP_NUM_TASKS"])
def test_a_process_of_another_launchers_world_is_refused_with_the_command_to_use(name: str) -> None:
    with pytest.raises(RuntimeError, match=rf"one of 4 started by another launcher \({name}=4.*elan run --nproc 4"):
        WorkerEnvironment.from_env({name: "4"})


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1"}, {"SLURM_STEP_NUM_TASKS": "1"}, {"WORLD_SIZE": ""}])
def test_a_process_alone_is_standalone(env: dict[str, str]) -> None:
    assert WorkerEnvironment.from_env(env).standalone


def test_a_worker_of_elan_run_is_not_refused_for_an_inherited_world_size() -> None:
    env = {"WORLD_SIZE": "4", "ELAN_AM_ADDRESS": "127.0.0.1:7", "ELAN_JOB": "job", "ELAN_WORKER_ID": "w0",
           "ELAN_STORE_ADDRESS": "127.0.0.1:8", "ELAN_RANK": "0", "ELAN_WORLD_SIZE": "2"}
    assert WorkerEnvironment.from_env(env).world_size == 2


@pytest.mark.parametrize("front_end", ["lightning", "accelerate"])
def test_a_script_under_torchrun_variables_fails_before_it_trains(front_end: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``torchrun --nproc_per_node 2 train.py`` gives each process, for a script with ``strategy="elan"`` or an
    ``ElasticAccelerator``: a clear error when it is built."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ELAN_AM_ADDRESS", raising=False)
    with pytest.raises(RuntimeError, match="not by `elan run`"):
        if front_end == "lightning":
            import lightning.pytorch as pl

            import lightning_elan  # noqa: F401  (registers strategy="elan")

            pl.Trainer(strategy="elan", accelerator="cpu", logger=False)
        else:
            from lightning_elan.accelerate import ElasticAccelerator

            ElasticAccelerator()

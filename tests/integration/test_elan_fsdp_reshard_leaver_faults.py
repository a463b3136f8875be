"""Deaths in the live reshard of an ``elan_fsdp`` scale-in (issue 24): the leaver's rows must reach the stayers, so a
death of the leaver itself, or of a stayer while the leaver lives, must abandon the reshard and recover from the old
layout (a dead member's shard from its mirror) without a hang, and the result must be the static run's.

Real ``elan run`` jobs of ``user_scripts/fsdp_mlp.py``, a process SIGKILLing itself at a chosen point of the reshard
(``--kill-at reshard``: its third transfer); checked as ``test_elan_fsdp_faults``' reshard kills are: exit 0, every
survivor released at once, each sample once per epoch, the final state within 1e-9 of the static 2-worker run's. A
hung run is killed after ``RUN_TIMEOUT_S`` and fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_elan_fsdp import FsdpRun, run_fsdp_job
from tests.integration.test_elan_fsdp_faults import assert_released_and_recovered, static_fsdp

pytestmark = pytest.mark.integration

__all__ = ["static_fsdp"]  # the module-scoped static run, shared with test_elan_fsdp_faults' definition


def test_the_leaver_killed_in_a_scale_in_reshard_releases_every_stayer(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 workers grown to 4 after step 2, rank 3 removed after step 4 (4 -> 3); the leaver SIGKILLs itself at its third
    transfer of that reshard (some of its rows moved, not all): the stayers 0, 1 and 2 are released, the reshard is
    abandoned, and they recover from the 4-member layout (the leaver's shard from rank 0's mirror)."""
    run = run_fsdp_job(tmp_path, "fsdpkillleaver", "--kill-step", "4", "--kill-at", "reshard", "--kill-rank", "3",
                       schedule="2:add=2,4:remove=rank:3")

    assert_released_and_recovered(run, static_fsdp, [("failure", 3)])


@pytest.mark.parametrize("stayer", [0, 1])
def test_a_stayer_killed_in_a_3_to_2_scale_in_reshard_takes_the_leavers_rows(tmp_path: Path, static_fsdp: FsdpRun,
                                                                             stayer: int) -> None:
    """2 workers grown to 3 after step 2, rank 2 removed after step 4 (3 -> 2); stayer 0 or 1 SIGKILLs itself at its
    third transfer of that reshard. In a ring of 3 the leaver holds rank 1's mirror and rank 0 holds the leaver's: the
    shards were taken from the survivors only, so either death lost a shard with its mirror (``ShardsLost``). The
    living leaver takes part in the recovery's reshard (its own shard, and rank 1's from its mirror) and then leaves;
    the lone survivor trains on; the result is the static run's."""
    run = run_fsdp_job(tmp_path, f"fsdpkillstayer{stayer}", "--kill-step", "4", "--kill-at", "reshard",
                       "--kill-rank", str(stayer), schedule="2:add=1,4:remove=rank:2")

    assert "ShardsLost" not in run.output and "died with their mirrors" not in run.output, run.excerpt()
    assert_released_and_recovered(run, static_fsdp, [("failure", 1)])
    assert "leaves the job: a member died in the live reshard" in run.output, run.excerpt()


"""A member of an ``elan_fsdp`` job SIGKILLed in Lightning's sanity check (on by default: 2 validation batches before
the first training step), as a spot instance can die while a job starts: the survivors recover, the dead member's
shard from its mirror, and the job trains exactly as a static run does. Before, the mirrors were seeded only as the
training loop started, and every survivor stopped with ``LostShard`` ("died before its shard was mirrored").

User script: ``user_scripts/fsdp_sanity_check.py`` (an ordinary LightningModule, validation each epoch, float64)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.fsdp_runs import assert_each_sample_once, assert_ok, elan_command, run_to_end

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "fsdp_sanity_check.py"
SAMPLES, EPOCHS, TOLERANCE = 96, 3, 1e-9


def run(home: Path, nproc: int, *args: str):
    command = [*elan_command(home, home.name, nproc), "--", "python", str(SCRIPT), str(home / "out"), *args]
    return run_to_end(command, home, timeout_s=300)


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """3 workers, nothing changes: the reference (the killed job keeps its launch global batch of 36 at 2 workers)."""
    result = run(tmp_path_factory.mktemp("fsdp_sanity") / "static", 3)
    assert_ok(result)
    return result


@pytest.mark.parametrize("units", [False, True], ids=["root", "units"])
def test_a_member_killed_in_the_sanity_check_loses_nothing(tmp_path, static, units):
    killed = run(tmp_path / "killed", 3, "--die-in-sanity-check", "w1", *(["--units"] if units else []))
    assert_ok(killed)
    assert "LostShard" not in killed.output and "Traceback" not in killed.output, killed.excerpt()
    assert [adjustment["failure"]["dead"] for adjustment in killed.adjustments() if "failure" in adjustment] == [["w1"]]
    assert "restores the shard of dead rank 1 from its mirror" in killed.output
    assert_each_sample_once(killed, list(range(EPOCHS)), SAMPLES)
    expected, final = static.final_state(), killed.final_state()
    assert expected.keys() == final.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=TOLERANCE, msg=name)

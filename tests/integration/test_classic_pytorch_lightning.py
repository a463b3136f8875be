"""`import pytorch_lightning as pl` (the classic package, its own class tree) trains elastically like
`lightning.pytorch`: the probe script written against `pytorch_lightning` grows, loses rank 0 and grows again under
`elan run`, and equals the `lightning.pytorch` static run within 1e-9."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.integration.elastic_runs import PROBE, PROBE_ARGS, RunResult, check_elastic_run, elan_env

pytestmark = pytest.mark.integration

# the probe's Lightning imports, as a `pytorch_lightning` user writes them
CLASSIC_IMPORTS = {
    "import lightning.pytorch as pl": "import pytorch_lightning as pl",
    "from lightning.pytorch.callbacks import": "from pytorch_lightning.callbacks import",
    "from lightning.pytorch.loggers import CSVLogger": "from pytorch_lightning.loggers import CSVLogger",
    "from lightning_elan.callbacks import": "from lightning_elan.pytorch_lightning import",
}


def test_classic_pytorch_lightning_grows_and_shrinks_exactly(static_run, tmp_path):
    source = PROBE.read_text()
    for lightning, classic in CLASSIC_IMPORTS.items():
        assert lightning in source
        source = source.replace(lightning, classic)
    assert "lightning.pytorch" not in source
    probe = tmp_path / "classic_probe.py"
    probe.write_text(source)
    shutil.copy(PROBE.with_name("hold_point.py"), tmp_path)  # the probe's sibling module
    schedule = "3:add=1,9:remove=rank:0,14:to=3"
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "classic",
               "--coordinate-every", "1", "--state-dir", str(tmp_path / "classic-state"), "--schedule", schedule,
               "--", sys.executable, str(probe), "--out", str(tmp_path / "classic"), *PROBE_ARGS, "--wait-for-joiners"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=elan_env(tmp_path))
    run = RunResult(tmp_path / "classic", tmp_path / "classic-state", proc.returncode, proc.stdout + proc.stderr)
    check_elastic_run(run, static_run, schedule, sizes=[3, 2, 3])


def test_classic_lightning_cli_takes_trainer_strategy_elan(tmp_path):
    from tests.integration.test_lightning_cli import SCRIPT

    source = SCRIPT.read_text().replace("import lightning.pytorch as pl", "import pytorch_lightning as pl")
    source = source.replace("from lightning.pytorch.cli import", "from pytorch_lightning.cli import")
    assert "lightning.pytorch" not in source
    script = tmp_path / "classic_cli.py"
    script.write_text(source)
    env = {key: value for key, value in elan_env(tmp_path).items() if not key.startswith("ELAN_")}
    proc = subprocess.run([sys.executable, str(script), "--trainer.strategy=elan", "--trainer.max_epochs=1",
                           "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                           "--trainer.enable_checkpointing=false"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy=ElanStrategy coordinate_every=10 steps=8 world=1" in proc.stdout

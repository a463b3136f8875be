"""LightningCLI users select the strategy from the command line or a YAML config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("cli_train.py")


def run_cli(*args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELAN_")}
    command = [sys.executable, str(SCRIPT), *args, "--trainer.max_epochs=1", "--trainer.logger=false",
               "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_trainer_strategy_elan_from_the_command_line(tmp_path):
    output = run_cli("--trainer.strategy=elan", cwd=tmp_path)
    assert "strategy=ElanStrategy coordinate_every=10 steps=8 world=1" in output


def test_elan_strategy_with_arguments_from_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_elan.ElanStrategy\n"
        "    init_args:\n      coordinate_every: 3\n"
    )
    assert "strategy=ElanStrategy coordinate_every=3 steps=8" in run_cli(f"--config={config}", cwd=tmp_path)

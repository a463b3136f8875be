"""From the user's side: a worker SIGTERMed on a busy host leaves, runs the rest of its script and exits with the job.

Two busy loops (another program's work on the same host) share the cores with a 3-worker job; w1 is SIGTERMed 1 s
after its spawn and leaves at its next batch boundary. It must exit 0 on its own, as an expected exit, before the
launcher's end-of-job kill, and w0 and w2 must end exactly as the static run. (A leaver used to drop to niceness 19:
on a busy host its interpreter's last garbage collection then took minutes, and ``elan run`` SIGKILLed it 30 s after
the job ended.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.elastic_runs import PROBE_ARGS, RunResult, assert_exact, elan_command
from tests.integration.test_sigterm_at_start import SignalledJob

pytestmark = pytest.mark.integration
HOGS = 2


def test_a_leaver_on_a_busy_host_exits_with_its_script_whole(static_run: RunResult, tmp_path) -> None:
    command = elan_command(tmp_path, "busy", 3, [*PROBE_ARGS, "--global-batch", "12", "--step-sleep", "0.3"],
                           coordinate_every=50, launcher_args=("--term-grace", "120"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        job = SignalledJob(tmp_path, "busy", command)
        pid = job.sigterm("w1", 1.0)
        run = job.finish()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()

    assert run.returncode == 0, run.excerpt()
    assert "still running" not in run.output, run.excerpt()
    assert f"w1 (pid {pid}) exited with code 0 (expected)" in run.output, run.excerpt()
    records = assert_exact(run, static_run)
    (leaver,) = [record for record in records if record["worker"] == "w1"]
    assert leaver["left"], leaver

"""From the user's side: workers forked from `elan run`'s preloaded interpreter (``launcher/preload.py``) see what a
freshly started ``python script.py`` sees. ``user_scripts/what_a_worker_sees.py`` (an ordinary Lightning script)
writes down its ``sys.argv``, ``__name__``, ``__file__``, ``sys.path[0]``, ``/proc/self/cmdline``, environment and
signal mask first thing; the same job (2 workers, a third added at step 3) runs with and without ``--no-preload`` and
each worker's view must be the same, the workers' draws from ``random`` and numpy's global generator must differ from
each other, and the preloaded job's workers, the joiner included, must be the preload process's children. A user's
own ``sitecustomize`` runs in each worker with that worker's environment: by default the launcher then starts the
workers afresh (saying why); with ``ELAN_PRELOAD_SITECUSTOMIZE=worker`` it runs in each forked worker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "user_scripts" / "what_a_worker_sees.py"
USER_SITE = Path(__file__).parent / "user_site"
PRELOADING = re.compile(r"preloading (.*) for the workers \(pid (\d+)\)")
SAME_FOR_EVERY_START = ("argv", "name", "file", "main_file", "path0", "cmdline", "pythonpath", "omp_threads",
                        "unexpected_vars", "blocked_signals", "torch_threads")


def run_job(tmp: Path, name: str, *launcher_args: str, env: dict[str, str] | None = None) -> tuple[str, dict]:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--state-dir",
               str(tmp / f"{name}-state"), "--schedule", "3:add=1", *launcher_args, "--", sys.executable, str(SCRIPT),
               str(tmp / "out")]  # the same command line in every run: it is part of what the workers see
    job = subprocess.run(command, env={**elan_env(tmp), **(env or {})}, capture_output=True, text=True, timeout=300)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-3000:]
    seen = {path.stem[len("seen-"):]: json.loads(path.read_text()) for path in (tmp / "out").glob("seen-*.json")}
    for path in (tmp / "out").glob("seen-*.json"):
        path.unlink()
    return output, seen


def test_a_forked_worker_sees_what_a_fresh_process_sees(tmp_path: Path) -> None:
    fresh_output, fresh = run_job(tmp_path, "fresh", "--no-preload")
    preloaded_output, preloaded = run_job(tmp_path, "preloaded")
    assert not PRELOADING.search(fresh_output), fresh_output[-3000:]
    match = PRELOADING.search(preloaded_output)
    assert match, preloaded_output[-3000:]
    assert "lightning.pytorch" in match.group(1) and "numpy" in match.group(1), match.group(0)
    assert set(fresh) == set(preloaded) == {"w0", "w1", "w2"}, (sorted(fresh), sorted(preloaded))
    for worker in ("w0", "w1", "w2"):
        for key in SAME_FOR_EVERY_START:
            assert preloaded[worker][key] == fresh[worker][key], (worker, key, preloaded[worker][key],
                                                                  fresh[worker][key])
    assert fresh["w0"]["cmdline"] == [sys.executable, str(SCRIPT), str(tmp_path / "out"), ""]
    assert {seen["ppid"] for seen in preloaded.values()} == {int(match.group(2))}  # the joiner too
    for seen in (fresh, preloaded):
        assert len({view["random"] for view in seen.values()}) == 3, seen
        assert len({view["numpy"] for view in seen.values()}) == 3, seen


def test_a_users_sitecustomize_runs_in_each_worker_with_its_environment(tmp_path: Path) -> None:
    site_log = tmp_path / "site.log"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(USER_SITE), os.environ.get("PYTHONPATH")])),
           "USER_SITE_LOG": str(site_log)}
    output, _ = run_job(tmp_path, "refused", env=env)
    assert "workers start without the preloaded interpreter" in output and "sitecustomize" in output, output[-3000:]
    assert worker_lines(site_log) == {("w0", False), ("w1", False), ("w2", False)}, site_log.read_text()
    site_log.unlink()
    output, _ = run_job(tmp_path, "in-each-worker", env={**env, "ELAN_PRELOAD_SITECUSTOMIZE": "worker"})
    assert PRELOADING.search(output) and "without the preloaded interpreter" not in output, output[-3000:]
    assert worker_lines(site_log) == {("w0", True), ("w1", True), ("w2", True)}, site_log.read_text()


def worker_lines(site_log: Path) -> set[tuple[str, bool]]:
    """``(worker id, torch imported before it ran)`` of each worker's line (others: the launcher's, the AM's)."""
    lines = [line.split() for line in site_log.read_text().splitlines()]
    return {(worker, imported == "True") for worker, _pid, imported in lines if worker != "-"}

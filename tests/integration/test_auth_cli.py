"""The AM's shared secret from the command line: `elan am --secret-file`, `elan status/scale --secret-file`, and the
refusals a user sees (real `elan` processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration


def elan(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_elan.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_an_am_with_a_secret_answers_only_its_holders(tmp_path):
    env = elan_env(tmp_path)
    key = secret_file(tmp_path / "key", "a-secret-for-this-job-only-0123456789")
    other = secret_file(tmp_path / "other", "somebody-else's-secret-0123456789")
    am = subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", "am", "--job", "guarded", "--secret-file",
                           str(key), "--state-dir", str(tmp_path / "state")], env=env, stderr=subprocess.PIPE,
                          text=True)
    try:
        deadline = time.monotonic() + 30
        while elan(env, "status", "--job", "guarded", "--secret-file", str(key)).returncode != 0:
            assert time.monotonic() < deadline and am.poll() is None, "the AM did not come up"
            time.sleep(0.2)
        unsigned = elan(env, "status", "--job", "guarded")
        assert unsigned.returncode != 0 and "requires a shared secret" in unsigned.stderr
        wrong = elan(env, "scale", "--job", "guarded", "--secret-file", str(other), "add", "1")
        assert wrong.returncode != 0 and "does not verify" in wrong.stderr
        assert "pending" in elan(env, "status", "--job", "guarded", "--secret-file", str(key), "--json").stdout
    finally:
        am.terminate()
        am.wait(timeout=30)


def test_an_open_bind_without_a_secret_and_a_bad_secret_file_are_refused(tmp_path):
    env = elan_env(tmp_path)
    open_bind = elan(env, "am", "--job", "open", "--bind", "tcp://0.0.0.0:0", "--state-dir", str(tmp_path / "s"))
    assert open_bind.returncode == 2 and "refusing to bind the AM to tcp://0.0.0.0:0 without a secret" in \
        open_bind.stderr
    short = secret_file(tmp_path / "short", "tiny")
    refused = elan(env, "status", "--job", "any", "--secret-file", str(short))
    assert refused.returncode == 2 and "use at least 16" in refused.stderr


def test_a_job_with_a_secret_grows_and_migrates_exactly(plain_runs, tmp_path):
    """`elan run --secret-file`: the AM, the launcher and every worker sign their messages, and each joiner's state
    header is checked before it is unpickled; the job still equals the plain static run."""
    from tests.integration.accelerate_runs import accelerate_run, check_accelerate_run

    key = secret_file(tmp_path / "key", "a-secret-for-this-job-only-0123456789")
    run = accelerate_run(tmp_path, "guarded", 2, ["--wait-for-joiners"], schedule="3:add=1,6:migrate=1",
                         secret_file=key)
    check_accelerate_run(run, plain_runs[1], sizes=[3, 3])

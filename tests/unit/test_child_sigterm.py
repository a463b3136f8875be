"""SIGTERM in the worker's DataLoader processes (``elastic/termination.py``, ``_ChildSigterm``): a DataLoader worker
forked while the watch is armed leaves a SIGTERM from anyone but its parent to its parent's leave and goes on serving
batches; its parent's SIGTERM still ends it, and any other child dies of SIGTERM as before. Real processes, real
signals (sent by the test: neither the DataLoader worker's parent nor the worker's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lightning_elan.protocol.contract import WorkerEnvironment

pytestmark = pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="the child takes SIGTERM by sigwaitinfo")

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import multiprocessing as mp
    from torch.utils.data import DataLoader

    from lightning_elan.elastic.termination import TerminationWatch
    from lightning_elan.protocol.contract import WorkerEnvironment

    def report(**facts):
        print(json.dumps(facts), flush=True)

    def sleep_when_started(started):
        started.set()  # past its after-fork callbacks: a SIGTERM now finds it as the rest of its life will
        time.sleep(60)

    def forked_sleeper():
        fork = mp.get_context("fork")
        started = fork.Event()
        child = fork.Process(target=sleep_when_started, args=(started,))
        child.start()
        started.wait(30)
        return child

    watch = TerminationWatch(WorkerEnvironment.from_env())
    watch.install()
    loader = iter(DataLoader(range(64), num_workers=1, batch_size=1))
    first = int(next(loader))
    loader_worker, sleeper = loader._workers[0], forked_sleeper()
    report(loader_worker=loader_worker.pid, sleeper=sleeper.pid)
    sys.stdin.readline()  # the test has SIGTERMed both
    sleeper.join(10)
    served = [first] + [int(next(loader)) for _ in range(5)]
    report(sleeper_exit=sleeper.exitcode, loader_worker_alive=loader_worker.is_alive(), served=served)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise: the loader still counts on it
    loader_worker.terminate()  # its parent's SIGTERM, as a DataLoader's shutdown sends a worker that does not stop
    loader_worker.join(10)
    watch.disarm()
    after = forked_sleeper()
    report(loader_worker_exit=loader_worker.exitcode, after_disarm=after.pid)
    sys.stdin.readline()  # the test has SIGTERMed it
    after.join(10)
    report(after_disarm_exit=after.exitcode)
    os._exit(0)  # the loader's worker was ended by hand: no DataLoader shutdown
    """
)


def test_a_dataloader_worker_leaves_others_sigterm_to_the_workers_leave() -> None:
    environment = WorkerEnvironment.launched(job="job", worker_id="w1", role="member", am_address="tcp://127.0.0.1:9",
                                             store_address="127.0.0.1:1", rank=1, world_size=2, term_grace_s=60)
    env = {**os.environ, **environment.to_env(), "PYTHONWARNINGS": "ignore"}
    worker = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert worker.stdin is not None and worker.stdout is not None
        forked = json.loads(worker.stdout.readline())
        os.kill(forked["loader_worker"], signal.SIGTERM)
        os.kill(forked["sleeper"], signal.SIGTERM)
        worker.stdin.write("sent\n")
        worker.stdin.flush()
        during = json.loads(worker.stdout.readline())
        after = json.loads(worker.stdout.readline())
        os.kill(after["after_disarm"], signal.SIGTERM)
        worker.stdin.write("sent\n")
        worker.stdin.flush()
        last = json.loads(worker.stdout.readline())
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
        worker.wait()
    assert during == {"sleeper_exit": -signal.SIGTERM, "loader_worker_alive": True, "served": list(range(6))}
    assert after["loader_worker_exit"] == -signal.SIGTERM
    assert last == {"after_disarm_exit": -signal.SIGTERM}

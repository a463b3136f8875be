"""A member loses the store that holds the commit vote (a ``TCPStore`` in another process, SIGKILLed — what happens
when rank 0, the fast store's host, dies) after it voted and before it read the decision: it cannot know whether
another member applied the step, and says so (``UncertainCommit``) instead of guessing; the recovery decides."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_elan.elastic.failures import CommitVote, PeerFailure, UncertainCommit
from tests.integration.elastic_runs import free_port

pytestmark = pytest.mark.integration

STORE_HOST = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("serving", flush=True)
time.sleep(600)
"""


def test_a_voter_that_loses_the_vote_store_before_the_decision_is_uncertain() -> None:
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "serving"
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=10))
        observer = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=10))
        vote = CommitVote(store, 0, 1, 3, lambda: False)  # rank 1 of 3: it waits for the other two votes
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(vote.commit)
            deadline = time.monotonic() + 30
            while observer.add("elan/gen0/commit1/votes", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert observer.add("elan/gen0/commit1/votes", 0) == 1  # its vote is in
            os.kill(host.pid, signal.SIGKILL)
            host.wait(30)
            with pytest.raises(UncertainCommit) as raised:
                pending.result(timeout=60)
        assert isinstance(raised.value, PeerFailure) and raised.value.generation == 0
        assert "the store holding the commit vote failed" in str(raised.value)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()

"""One process of the rendezvous-store comparison: ``python -m bench.rendezvous_worker ADDRESS RANK WORLD GENS OUT``.

Through the rendezvous store at ``ADDRESS`` (``HOST:PORT`` → TCPStore, ``etcd://…?job=JOB`` → etcd), forms ``GENS``
successive gloo generations of ``WORLD`` processes with :class:`ElasticProcessGroup` (as an elastic job does after
each adjustment), checks one all-reduce per generation, votes once per generation with :class:`CommitVote`, and writes
the formation times (seconds) and the all-reduce sums as JSON to ``OUT``. Rank 0 then deletes the generations' keys
(``replication.keys.delete_prefix``, which needs ``list_keys``).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch

from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store
from lightning_elan.elastic.failures import CommitVote
from lightning_elan.elastic.process_group import ElasticProcessGroup
from lightning_elan.replication.keys import delete_prefix

PREFIX = "bench/rdzv"


def main(address: str, rank: int, world: int, generations: int, out: str) -> None:
    store = open_rendezvous_store(address, timedelta(seconds=60))
    group = ElasticProcessGroup(store, "gloo", timedelta(seconds=60), torch.device("cpu"))
    formation, sums, commits = [], [], []
    for generation in range(generations):
        started = time.perf_counter()
        group.configure(f"{PREFIX}/gen{generation}/", rank, world)
        total = torch.tensor([float(rank + 1)])
        group.current.allreduce([total]).wait()
        formation.append(time.perf_counter() - started)
        sums.append(total.item())
        commits.append(CommitVote(store, generation, rank, world, lambda: False).commit())
    group.current.barrier().wait()
    group.shutdown()
    deleted = delete_prefix(store, f"{PREFIX}/") if rank == 0 else 0
    with open(out, "w") as file:
        json.dump({"formation_s": formation, "sums": sums, "commits": commits, "deleted": deleted}, file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

"""Test-only: a process whose generation fails while its gloo backend connects through the etcd rendezvous store
(the peer of rank 1 never arrives), as a survivor's does when a joiner dies in the generation forming; it abandons
the connect, goes on and exits 0. ``python tests/integration/abandoned_connect.py ETCD_URL`` (etcd storm seed 9010:
such a survivor finished training, then died at exit, "terminate called without an active exception")."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_elan.elastic import process_group
from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store

FAILS_AFTER_S = 1.0


def main(url: str) -> int:
    client = process_group._own_client(open_rendezvous_store(url, timedelta(seconds=60)))
    failed_at = time.monotonic() + FAILS_AFTER_S

    def raise_if_failed() -> None:
        if time.monotonic() > failed_at:
            raise RuntimeError("generation 1 failed: a member died")

    def connect() -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(dist.PrefixStore("generation-1/", client), 0, 2, timedelta(seconds=60))

    try:
        process_group._connect_watching(connect, raise_if_failed, client)
    except RuntimeError as error:
        print(f"abandoned the connect: {error}", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

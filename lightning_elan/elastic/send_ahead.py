"""When a worker makes its shared-memory send segment ahead of an adjustment: the ``ELAN_SEND_AHEAD`` policy.

Any member may be chosen as a joiner's source, and a source's first write into a new tmpfs segment is the costly part
of its send (:mod:`lightning_elan.replication.send_segment`). So at a coordination whose answer says a queued request
starts new workers (``joiners_coming``), every member of a CPU job starts making a segment the size of its state, in a
thread, while the joiners warm up; the send of the adjustment writes into it and keeps it. The modes:

* ``joiners`` (default): prepared while joiners are coming; removed at the first coordination with none coming (a
  member holds one segment of its state's size from the request until then: 12 bytes per parameter with Adam);
* ``always``: prepared at the first coordination and kept for the worker's life (also for joiners that need no
  warm-up, e.g. standby workers), at the same memory cost for the whole job;
* ``off``: none; a source creates its segment inside the adjustment, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lightning_elan.replication.send_segment import SendSegment
from lightning_elan.replication.transports.shm import default_shm_dir

log = logging.getLogger(__name__)

__all__ = ["SEND_AHEAD_MODES", "SendAhead"]

SEND_AHEAD_MODES = ("joiners", "always", "off")
SLACK_BYTES = 1 << 20
"""Made this much larger than the state's tensors: the arena aligns each dtype buffer to 256 bytes."""


class SendAhead:
    """One worker's send segment and when it exists."""

    def __init__(self, mode: str) -> None:
        if mode not in SEND_AHEAD_MODES:
            raise ValueError(f"send_ahead must be one of {SEND_AHEAD_MODES}, got {mode!r}")
        self.mode = mode
        self.segment: SendSegment | None = None
        self.joiners_coming_at_start = False  # the AM said so when this member registered

    def at_coordination(self, joiners_coming: bool, state_nbytes: Callable[[], int]) -> None:
        """After a coordination that decided no adjustment: prepare the segment, or let it go."""
        if self.mode == "off":
            return
        if joiners_coming or self.mode == "always":
            if self.segment is None:
                self.segment = SendSegment(default_shm_dir())
            self.segment.prepare(state_nbytes() + SLACK_BYTES)
        elif self.segment is not None:
            self.segment.release()

    def close(self) -> None:
        """The worker is done: remove the segment (once a send that uses it is over)."""
        if self.segment is not None:
            self.segment.release()

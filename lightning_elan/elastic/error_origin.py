"""Where an error out of a training step was raised: in communication a member's death may have broken, or in the
user's own code.

A worker whose step raised cannot tell at once a bug of its own from a collective broken by a peer's death: the AM's
notice of the death may arrive seconds later. Waiting for it (up to a minute, :data:`~lightning_elan.elastic.worker.
FAILURE_NOTICE_S`) is right for the first and wrong for the second: a dtype mismatch in the user's forward would
surface only after that minute. What a death breaks is communication, so the error is classified by where it was
raised, over the exception and its ``__cause__``/``__context__`` chain:

* an error raised inside communication code — ``torch.distributed`` (c10d, its stores), DDP's module (the reducer
  runs there), ``lightning_elan`` (its collectives, votes, store and AM links), ZeroMQ — may be a death;
* so may one whose type says so (torch's ``DistError``\\ s, ``ConnectionError``, ``TimeoutError``,
  :class:`~lightning_elan.elastic.failures.PeerFailure`) or whose message names a broken transport: a collective run by
  the autograd engine (DDP's gradient all-reduce in ``backward``) surfaces as a ``RuntimeError`` raised from
  ``torch/autograd``, with gloo's words in it ("Connection reset by peer", "Connection closed by peer", "Timed out");
* anything else — raised in the user's code, in Lightning, or in a torch op the user called outside any collective
  (``mat1 and mat2 must have the same dtype``, ``torch.OutOfMemoryError``, an ``AssertionError``, a loss's
  ``ValueError``) — is the process's own.

Observed (2 workers, gloo, one SIGKILLed in its forward, backward or optimizer step): the survivor's error was a
``RuntimeError`` raised in ``torch/autograd/graph.py`` naming gloo's "Connection reset by peer" (backward), one raised
in ``lightning_elan/elastic/process_group.py`` (the all-reduce of a metric logged with ``sync_dist``, the agreement's
broadcast at the batch boundary), or :class:`PeerFailure` (the commit vote).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType

import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module

from lightning_elan.elastic.failures import PeerFailure

__all__ = ["PROGRAMMING_ERRORS", "is_a_collective_timeout", "may_be_a_peers_death", "raised_in_communication"]

PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, KeyError, IndexError, ZeroDivisionError,
                      NotImplementedError, ImportError, SyntaxError)
"""Errors of this process's own code wherever they were raised, never of a collective a peer's death broke (those
raise ``RuntimeError``\\ s: gloo's, torch's ``DistError``\\ s, :class:`PeerFailure`)."""

DEATH_TYPES: tuple[type[BaseException], ...] = (dist.DistError, ConnectionError, TimeoutError)
"""Errors whose type says communication failed."""

TRANSPORT_WORDS = ("gloo", "nccl", "connection reset", "connection closed", "connection refused", "broken pipe",
                   "timed out", "socket", "reducer.cpp", "a member of generation")
"""Words (lower case) in the message of an error a broken transport raised: gloo's and NCCL's, a socket's, DDP's
reducer's (its internal asserts after an interrupted reduction), and :class:`PeerFailure`'s (which the autograd engine
rewraps when DDP's communication hook raises it)."""


def _directory(module_file: str | None) -> str:
    return os.path.dirname(os.path.abspath(module_file or "")) + os.sep


COMMUNICATION_CODE: tuple[str, ...] = (
    _directory(dist.__file__),
    os.path.abspath(ddp_module.__file__ or ""),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # the lightning_elan package
)
"""Where code that communicates lives: an error whose innermost frame is there may be a death. Paths are prefixes
(a directory ends with the separator)."""


def _zmq_directory() -> str | None:
    try:
        import zmq
    except ImportError:  # pragma: no cover - zmq is a dependency
        return None
    return _directory(zmq.__file__)


_ZMQ = _zmq_directory()


def may_be_a_peers_death(error: BaseException) -> bool:
    """Whether ``error`` may come from communication a member's death broke (see the module's docstring); False: it
    is this process's own error (a bug in the user's code, an out-of-memory, a failed assertion), re-raised at once."""
    if isinstance(error, PROGRAMMING_ERRORS):
        return False
    return any(_names_a_failed_transport(link) or raised_in_communication(link.__traceback__) for link in _chain(error))


def is_a_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` says a collective or a store wait ran out its timeout: gloo's "Timed out waiting 10000ms for
    recv operation to complete", NCCL's watchdog, a ``DistStoreError`` "wait timeout". A peer that died resets its
    connections and fails the collective at once; one whose process is frozen (SIGSTOP, a swapped-out host) or hung
    outside the collective lets it time out. Not a user's own timeout (an HTTP read in a callback): the error must come
    from torch.distributed or name gloo or NCCL."""
    return any(_names_a_timeout(link) and (isinstance(link, dist.DistError) or _names_a_backend(link))
               for link in _chain(error))


def _names_a_timeout(error: BaseException) -> bool:
    message = str(error).lower()
    return "timed out" in message or "timeout" in message


def _names_a_backend(error: BaseException) -> bool:
    message = str(error).lower()
    return "gloo" in message or "nccl" in message


def raised_in_communication(trace: TracebackType | None) -> bool:
    """Whether the innermost frame of ``trace`` is in communication code."""
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    return trace is not None and _is_communication_code(trace.tb_frame.f_code.co_filename)


def _is_communication_code(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(COMMUNICATION_CODE) or (_ZMQ is not None and path.startswith(_ZMQ))


def _names_a_failed_transport(error: BaseException) -> bool:
    if isinstance(error, (PeerFailure, *DEATH_TYPES)):
        return True
    message = str(error).lower()
    return any(word in message for word in TRANSPORT_WORDS)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from or while handling, each once."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__

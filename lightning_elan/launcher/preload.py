"""The preloaded interpreter of ``elan run``: the command's heavy imports paid once per job, not once per worker.

A worker spends its first seconds importing torch and Lightning (8 CPU-seconds on the 2-core development machine,
where that is most of a joiner's warm-up). For a command of the form ``python [options] script.py ...`` or
``python [options] -m module ...`` run by the interpreter ``elan`` itself runs in, the launcher starts the command once
more as a *preload process*: the same command line, with ``preload_site/`` first on ``PYTHONPATH``. That directory's
``sitecustomize`` (run by Python's ``site`` module before the script) imports the libraries the script imports
(:func:`modules_to_preload`: torch, Lightning, Accelerate, transformers ... only, never the user's own modules), then
forks one child per worker the launcher asks for over two pipes. Each child takes the worker's environment, signal mask
and parent-death signal, and goes on starting up as ``python script.py`` would: ``sys.argv``, ``sys.path[0]``,
``__main__``, tracebacks, ``/proc/PID/cmdline`` and exit status are those of the command; the libraries are already
imported. The preload process shows ``elan-preload`` as its command line and runs no user code.

What differs from a fresh process, and is documented: ``/proc/PID/environ`` shows the launcher's environment (a
worker's ``os.environ`` is its own); a library that reads a per-worker ``ELAN_*`` variable at import time would read
none (the preloaded libraries do not); workers share one hash seed (``random`` and numpy reseed in each). The preload
process refuses to serve (the launcher then starts workers as before, with a log line) when its imports started a
thread or initialized CUDA (a forked process could not use either). ``elan run --no-preload`` turns it off.

Exit statuses: the workers are the preload process's children; it reports each one's exit (``returncode`` as
:class:`subprocess.Popen` has it) and :class:`ForkedWorker` gives the launcher the ``Popen`` methods it uses. Signals go
through a pidfd where the kernel has them, so a signal never reaches a recycled pid. If the preload process dies, its
workers die with it (parent-death signal), as every worker dies with ``elan run``.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import importlib.machinery
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_elan.launcher.job_store import ForkedStore, StoreLost
from lightning_elan.launcher.lifeline import die_with_parent

log = logging.getLogger(__name__)

__all__ = ["ForkedWorker", "PreloadableCommand", "PreloadedInterpreter", "modules_to_preload", "preloadable_command"]

SITE_DIR = Path(__file__).with_name("preload_site")
CHANNEL_VAR = "ELAN_PRELOAD_CHANNEL"  # read by preload_site/sitecustomize.py (standard library only: named twice)
STORE_CHANNEL_VAR = "ELAN_PRELOAD_STORE_CHANNEL"
MODULES_VAR = "ELAN_PRELOAD_MODULES"
SITECUSTOMIZE_VAR = "ELAN_PRELOAD_SITECUSTOMIZE"  # "worker": a hidden sitecustomize may run in each forked worker
# what the preload process imports when the script (or a module next to it) imports it: libraries whose import is slow
# and reads no per-worker environment variable at import time
PRELOADED_LIBRARIES = (
    "torch", "numpy", "lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric",
    "accelerate", "transformers", "torchvision", "torchmetrics", "lightning_elan",
)
# interpreter options that change nothing a preload could get wrong (-E, -I, -S, -s would skip or isolate the hook)
_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-b", "-bb", "-q", "-v"})
_FLAGS_WITH_VALUE = frozenset({"-W", "-X"})
_MAX_SCANNED_FILES = 64


class PreloadUnavailable(RuntimeError):
    """The preload process is gone or refused to serve: start workers without it."""


@dataclass(frozen=True)
class PreloadableCommand:
    """A worker command the preload process can start: ``python [options] script|-m module [args]``."""

    argv: tuple[str, ...]
    modules: tuple[str, ...]


def preloadable_command(command: Sequence[str], executable: str = sys.executable) -> PreloadableCommand | None:
    """The command as a :class:`PreloadableCommand`, or None when it is not run by ``executable`` with safe options."""
    if not command or not _same_interpreter(command[0], executable):
        return None
    target = _script_or_module(list(command[1:]))
    if target is None:
        return None
    kind, name = target
    path = Path(name) if kind == "script" else _module_file(name)
    return PreloadableCommand(tuple(command), modules_to_preload(path))


def _same_interpreter(program: str, executable: str) -> bool:
    found = shutil.which(program)
    if found is None:
        return False
    with contextlib.suppress(OSError):
        return (os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(executable))
                and os.path.samefile(found, executable))
    return False


def _script_or_module(args: list[str]) -> tuple[str, str] | None:
    """``("script", path)`` or ``("module", name)`` after the interpreter's options; None for anything else."""
    while args:
        arg = args.pop(0)
        if arg in _FLAGS:
            continue
        if arg in _FLAGS_WITH_VALUE and args:
            args.pop(0)
            continue
        if arg[:2] in _FLAGS_WITH_VALUE and len(arg) > 2:
            continue
        if arg == "-m" and args:
            return "module", args[0]
        if arg.startswith("-"):
            return None
        return ("script", arg) if os.path.isfile(arg) else None
    return None


def _module_file(name: str) -> Path | None:
    """The file ``python -m name`` runs (found without importing anything), if it is a plain source module."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
        main = Path(spec.submodule_search_locations[0]) / "__main__.py"
        return main if main.is_file() else None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def modules_to_preload(script: Path | None) -> tuple[str, ...]:
    """The :data:`PRELOADED_LIBRARIES` that ``script`` or the modules next to it that it imports import (torch always
    first: every elan worker imports it)."""
    wanted = {"torch"}
    for imported in _imports_of(script):
        wanted.update(_library_of(imported))
    return tuple(name for name in PRELOADED_LIBRARIES if name in wanted)


def _library_of(imported: str) -> set[str]:
    """The longest of :data:`PRELOADED_LIBRARIES` that ``imported`` is or is inside (none when it is none of them)."""
    parts = imported.split(".")
    prefixes = (".".join(parts[:length]) for length in range(len(parts), 0, -1))
    return next(({prefix} for prefix in prefixes if prefix in PRELOADED_LIBRARIES), set())


def _imports_of(script: Path | None) -> Iterator[str]:
    """Every absolute import in ``script`` and, transitively, in the modules of its directory it imports."""
    if script is None:
        return
    todo, seen = [script], set()
    while todo and len(seen) < _MAX_SCANNED_FILES:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports_in(path):
            yield name
            local = script.parent / (name.split(".")[0] + ".py")
            if local.is_file():
                todo.append(local)


def _imports_in(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


class PreloadedInterpreter:
    """The launcher's side of the preload process: start it, fork workers from it, learn their exits."""

    def __init__(self, command: PreloadableCommand, env: Mapping[str, str], store_host: str | None = None) -> None:
        self.command = command
        self._env = dict(env)
        self._store_host = store_host  # fork the job's store host bound there (``launcher/job_store.py``)
        self._process: subprocess.Popen[bytes] | None = None
        self._request_fd = -1
        self._reply_fd = -1
        self._store_fds: tuple[int, int] | None = None  # the launcher's ends of the store host's pipes
        self._store_forked = False
        self._buffer = b""
        self._replies: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self.ready = False

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        (request_read, self._request_fd), (self._reply_fd, reply_write) = _pipe_pair()
        os.set_blocking(self._reply_fd, False)
        theirs = [request_read, reply_write]
        env = self._preload_env(request_read, reply_write)
        if self._store_host is not None:
            (store_read, store_request), (store_reply, store_write) = _pipe_pair()
            self._store_fds = (store_request, store_reply)
            theirs += [store_read, store_write]
            env[STORE_CHANNEL_VAR] = f"{store_read},{store_write},{self._store_host}"
        try:
            self._process = subprocess.Popen(list(self.command.argv), env=env, pass_fds=tuple(theirs),
                                             preexec_fn=die_with_parent(signal.SIGKILL))
        finally:
            for fd in theirs:
                os.close(fd)
        log.info("preloading %s for the workers (pid %d)", ", ".join(self.command.modules), self._process.pid)

    def forked_store(self) -> ForkedStore | None:
        """The job's store in the store host the preload process forked once ready (None when it did not)."""
        fds, self._store_fds = self._store_fds, None
        if fds is None:
            return None
        if not self._store_forked:
            _close_all(fds)
            return None
        try:
            return ForkedStore(*fds)
        except StoreLost as exc:
            log.warning("the store host did not start (%s): the launcher serves the job's store", exc)
            _close_all(fds)
            return None

    def _preload_env(self, request_fd: int, reply_fd: int) -> dict[str, str]:
        env = dict(self._env)
        env[CHANNEL_VAR] = f"{request_fd},{reply_fd}"
        env[MODULES_VAR] = ",".join(self.command.modules)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *filter(None, [env.get("PYTHONPATH")])])
        return env

    def wait_ready(self, timeout_s: float, check: Callable[[], None] = lambda: None) -> bool:
        """Wait for the preload process's imports; False (and the process stopped) when it refuses or fails."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            reply = self._next_reply(min(0.1, max(0.0, deadline - time.monotonic())))
            check()
            if reply is not None and "ready" in reply:
                return self._take_ready(reply)
            if self._gone() or time.monotonic() >= deadline:
                reason = "it exited" if self._gone() else f"it was not ready after {timeout_s:.0f} s"
                return self._give_up(reason)
        return True

    def _take_ready(self, reply: dict[str, Any]) -> bool:
        if not reply["ready"]:  # it refused (a reason of the command's own), as it may
            return self._give_up(str(reply.get("reason")), logging.INFO)
        self.ready = True
        self._store_forked = bool(reply.get("store"))
        return True

    def _give_up(self, reason: str, level: int = logging.WARNING) -> bool:
        log.log(level, "workers start without the preloaded interpreter: %s", reason)
        self.stop()
        return False

    def spawn(self, env: Mapping[str, str], *, hold_sigterm: bool = True, timeout_s: float = 30.0) -> ForkedWorker:
        """Fork one worker with ``env``; raises :class:`PreloadUnavailable` when the preload process cannot."""
        if not self.ready:
            raise PreloadUnavailable("the preload process is not serving")
        request = json.dumps({"env": dict(env), "hold_sigterm": hold_sigterm}).encode() + b"\n"
        try:
            os.write(self._request_fd, request)
        except OSError as exc:
            raise self._unavailable(f"it does not take requests ({exc})") from exc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self._next_reply(0.05)
            if reply is not None and "spawned" in reply:
                return ForkedWorker(int(reply["spawned"]), self)
            if self._gone():
                break
        raise self._unavailable("it did not fork the worker")

    def _unavailable(self, reason: str) -> PreloadUnavailable:
        log.warning("the preload process stopped serving (%s): later workers start without it", reason)
        self.stop()
        return PreloadUnavailable(reason)

    def returncode_of(self, pid: int) -> int | None:
        """The exit of worker ``pid`` once known (``-SIGKILL`` when the preload process died before reporting it)."""
        self._read_replies(0.0)
        if pid in self._exits:
            return self._exits[pid]
        if self._gone() and not _running(pid):
            self._exits[pid] = -signal.SIGKILL
        return self._exits.get(pid)

    def stop(self, grace_s: float = 5.0) -> None:
        """Close the channel (the preload process exits once its workers have); kill it after ``grace_s``."""
        self.ready = False
        if self._request_fd >= 0:
            os.close(self._request_fd)
            self._request_fd = -1
        if self._process is None:
            return
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def close(self) -> None:
        self.stop()
        if self._reply_fd >= 0:
            os.close(self._reply_fd)
            self._reply_fd = -1
        if self._store_fds is not None:  # never taken: the store host, if any, ends
            _close_all(self._store_fds)
            self._store_fds = None

    def _gone(self) -> bool:
        return self._process is None or self._process.poll() is not None

    def _next_reply(self, timeout_s: float) -> dict[str, Any] | None:
        self._read_replies(timeout_s)
        return self._replies.pop(0) if self._replies else None

    def _read_replies(self, timeout_s: float) -> None:
        """Read what the preload process wrote; exits are recorded, other replies queued."""
        if self._reply_fd < 0 or not select.select([self._reply_fd], [], [], timeout_s)[0]:
            return
        with contextlib.suppress(BlockingIOError):
            self._buffer += os.read(self._reply_fd, 1 << 16)
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in filter(None, lines):
            reply = json.loads(line)
            if "exited" in reply:
                self._exits[int(reply["exited"])] = int(reply["returncode"])
            else:
                self._replies.append(reply)


def _pipe_pair() -> tuple[tuple[int, int], tuple[int, int]]:
    """Two pipes, ``(read, write)`` each, that no child inherits unless passed."""
    pipes = (os.pipe(), os.pipe())
    for fd in (*pipes[0], *pipes[1]):
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    return pipes


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class ForkedWorker:
    """A worker forked by the preload process, with the :class:`subprocess.Popen` methods the launcher uses."""

    def __init__(self, pid: int, interpreter: PreloadedInterpreter) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._interpreter = interpreter
        self._pidfd = _open_pidfd(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._interpreter.returncode_of(self.pid)
            if self.returncode is not None:
                self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the worker unless it is known to have exited (as ``Popen.send_signal``)."""
        if self.poll() is not None:
            return
        if self._pidfd >= 0:
            signal.pidfd_send_signal(self._pidfd, signum)
        else:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def __del__(self) -> None:
        self._close_pidfd()


def _open_pidfd(pid: int) -> int:
    """A pidfd of ``pid`` (signals through it never reach a recycled pid); -1 where the kernel has none."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None or not hasattr(signal, "pidfd_send_signal"):
        return -1
    try:
        return opener(pid)
    except OSError:  # already reaped (it exited at once), or no pidfd support
        return -1


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

"""The start-up hook of ``elan run``'s preloaded interpreter (``launcher/preload.py``).

``elan run`` starts the user's command once more than it has workers, with this directory first on ``PYTHONPATH`` and
``ELAN_PRELOAD_CHANNEL`` set: Python's ``site`` module imports this file while the interpreter starts, before the
command's script or module runs. Here that process imports the heavy libraries the script imports (torch, Lightning,
Accelerate, ...), once, and then forks one child per worker the launcher asks for. Each child takes the worker's
environment, signal mask and parent-death signal, and returns from this hook: the interpreter goes on starting up and
runs the command's script as ``__main__`` exactly as ``python script.py`` would (same ``sys.argv``, ``sys.path[0]``,
tracebacks, exit status), with the libraries already imported. The preload process itself never returns from this
hook: it serves fork requests until the launcher closes the channel, then exits. In any process without
``ELAN_PRELOAD_CHANNEL`` this hook only takes its directory off ``sys.path`` and runs the ``sitecustomize`` it shadows.

Standard library only: the command's interpreter may not be the one ``elan`` runs in.

The channel: the launcher writes one JSON line per worker (``{"env": {...}, "hold_sigterm": bool}``) on the request
pipe; this process answers on the reply pipe with JSON lines: ``{"ready": true}`` (or ``{"ready": false, "reason":
...}``) once preloaded, ``{"spawned": pid}`` per request, ``{"exited": pid, "returncode": code}`` per child that ended
(``returncode`` as ``subprocess.Popen`` gives it: negative for a signal).

The job's rendezvous store: with ``ELAN_PRELOAD_STORE_CHANNEL`` set (two more pipes and the host to bind), this process,
once preloaded, forks the *store host* before any worker: a grandchild (its parent exits at once, so it is neither a
worker nor reaped here) that serves a torch ``TCPStore``, says ``{"port": N}`` on its reply pipe and answers the
launcher's ``{"op": "check", "keys": [...]}`` and ``{"op": "set", "key": ..., "value": ...}`` with ``{"result": ...}``
(or ``{"error": ...}``) until the launcher closes its end or dies. ``{"ready": ..., "store": true}`` says it was forked.
The launcher then never imports torch itself (``launcher/job_store.py``).
"""

import ctypes
import importlib.machinery
import importlib.util
import json
import os
import select
import signal
import sys
import threading
import traceback

CHANNEL_VAR = "ELAN_PRELOAD_CHANNEL"  # "<request fd>,<reply fd>"
MODULES_VAR = "ELAN_PRELOAD_MODULES"  # comma-separated modules to import before forking
# "worker": a sitecustomize this one hides may run in each worker after the fork (after the preloaded imports), as the
# last step of its start-up; without it such a module makes the preload process refuse to serve (it would run once,
# before the imports, without the worker's environment, where a fresh worker runs it first, with its own)
SITECUSTOMIZE_VAR = "ELAN_PRELOAD_SITECUSTOMIZE"
STORE_CHANNEL_VAR = "ELAN_PRELOAD_STORE_CHANNEL"  # "<request fd>,<reply fd>,<host>": fork the job's store host
TITLE = b"elan-preload"  # what /proc/PID/cmdline of the preload process shows (its children show the command)
STORE_TITLE = b"elan-store"  # ... and what the store host's shows
PR_SET_PDEATHSIG = 1
REAP_INTERVAL_S = 0.05
_HERE = os.path.dirname(os.path.abspath(__file__))


def _drop_this_directory():
    """Take this directory off ``sys.path`` and ``PYTHONPATH`` (nothing the command runs should see it)."""
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    kept = [entry for entry in entries if os.path.abspath(entry) != _HERE]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)


def _shadowed_sitecustomize():
    """The spec of the ``sitecustomize`` module this one hides (a distribution's, a user's), or None."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None or os.path.dirname(os.path.abspath(spec.origin or "")) == _HERE:
        return None
    return spec


def _run_sitecustomize(spec):
    """Run a hidden ``sitecustomize`` as ``site`` would have."""
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


class _ProcessTitle:
    """This process's command line as ``/proc/PID/cmdline`` shows it: the bytes of the argument area the kernel set up
    (``arg_start``..``arg_end`` of ``/proc/self/stat``), which CPython copied at start-up and never reads again."""

    def __init__(self):
        self.address, self.original = self._argument_area()

    @staticmethod
    def _argument_area():
        try:
            with open("/proc/self/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
            return start, ctypes.string_at(start, end - start)
        except (OSError, IndexError, ValueError):
            return 0, b""

    def show(self, title):
        """Show ``title`` (cut to the area's length) instead of the original command line."""
        if self.address and len(self.original) > 1:
            text = title[: len(self.original) - 1]
            ctypes.memmove(self.address, text + b"\0" * (len(self.original) - len(text)), len(self.original))

    def restore(self):
        if self.address and self.original:
            ctypes.memmove(self.address, self.original, len(self.original))


class _Channel:
    """The two pipes to the launcher, JSON lines each way."""

    def __init__(self, text):
        self.request_fd, self.reply_fd = (int(part) for part in text.split(","))
        self.buffer = b""
        self.open = True

    def send(self, message):
        try:
            os.write(self.reply_fd, json.dumps(message).encode() + b"\n")
        except OSError:  # the launcher is gone or closed its end: the children still run to their end
            pass

    def requests(self, timeout_s):
        """The requests that arrive within ``timeout_s`` (none when the launcher has closed its end)."""
        if not self.open or not select.select([self.request_fd], [], [], timeout_s)[0]:
            return []
        data = os.read(self.request_fd, 1 << 20)
        if not data:
            self.open = False
            return []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def close(self):
        for fd in (self.request_fd, self.reply_fd):
            os.close(fd)


def _load_prctl():
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def _preload(modules):
    """Import ``modules``; the reason this process cannot serve forks, or None. A module that fails to import is left
    out (each worker's script meets the same error itself)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # the worker reports it, with its traceback, when its script imports it
            pass
    if threading.active_count() > 1:
        return "the preloaded libraries started threads: forking would copy their locks"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "the preloaded libraries initialized CUDA, which a forked process cannot use"
    return None


class _PreloadServer:
    """The preload process: fork a worker per request, report each child's exit, end when the launcher is done."""

    def __init__(self, channel, title):
        self.channel = channel
        self.title = title
        self.children = set()
        self.prctl = _load_prctl()
        self.pid = os.getpid()

    def serve(self):
        """Return only in a forked child, with the worker's request; exit the process otherwise."""
        while self.channel.open or self.children:
            for request in self.channel.requests(REAP_INTERVAL_S):
                pid = self._fork()
                if pid == 0:
                    return request
                self.children.add(pid)
                self.channel.send({"spawned": pid})
            self._reap()
        os._exit(0)

    def _fork(self):
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        return os.fork()

    def _reap(self):
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            self.children.discard(pid)
            self.channel.send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})

    def become_worker(self, request):
        """In the child: the worker's environment, command line, signals and parent-death signal."""
        self.channel.close()
        self.title.restore()
        os.environ.clear()
        os.environ.update(request["env"])
        unblocked = {signal.SIGINT} if request.get("hold_sigterm") else {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, unblocked)
        if self.prctl is not None:
            self.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != self.pid:  # the preload process died before the prctl
                os._exit(128 + int(signal.SIGKILL))
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # a fresh process seeds numpy's global generator from the OS; so does each worker
            numpy.random.seed()


def _serve(channel_text, sitecustomize):
    """The preload process; returns in each forked worker only (which then runs ``sitecustomize``, if any)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # a worker's signals, not ours
    channel = _Channel(channel_text)
    title = _ProcessTitle()
    modules = [name for name in os.environ.pop(MODULES_VAR, "").split(",") if name]
    store_channel = os.environ.pop(STORE_CHANNEL_VAR, None)
    server = None
    try:
        reason = _refusal(sitecustomize) or _preload(modules)
        hosted = store_channel is not None and _fork_store_host(store_channel, channel, title, reason is None)
        channel.send({"ready": reason is None, "reason": reason, "store": hosted})
        if reason is not None:
            os._exit(0)
        title.show(TITLE)
        server = _PreloadServer(channel, title)
        request = server.serve()
    except BaseException:  # never run the command's script in the preload process
        traceback.print_exc()
        os._exit(1)
    _become_worker_or_exit(server, request, sitecustomize)


def _fork_store_host(text, channel, title, wanted):
    """Fork the store host (when ``wanted`` and torch is preloaded); whether it was. This process keeps none of the
    store's pipes: the workers it forks later must not hold them."""
    request_fd, reply_fd, host = text.split(",", 2)
    request_fd, reply_fd = int(request_fd), int(reply_fd)
    try:
        if not wanted or "torch" not in sys.modules:
            return False
        pid = os.fork()
        if pid == 0:
            _detached_store_host(_Channel(f"{request_fd},{reply_fd}"), host, channel, title)
        os.waitpid(pid, 0)  # the intermediate child, which exits at once
        return True
    finally:
        os.close(request_fd)
        os.close(reply_fd)


def _detached_store_host(store_channel, host, channel, title):
    """In the forked child: fork again and exit, so the store host is nobody's worker; the host never returns."""
    code = 1
    try:
        if os.fork() != 0:
            os._exit(0)
        channel.close()  # the preload process's pipes: only the launcher and the preload process hold them
        title.show(STORE_TITLE)
        _StoreHost(store_channel, host).serve()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class _StoreHost:
    """The job's rendezvous store (a torch ``TCPStore`` server) and the launcher's ``check``/``set`` on it."""

    def __init__(self, channel, host):
        self.channel = channel
        self.store = sys.modules["torch"].distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)

    def serve(self):
        """Answer the launcher until it closes its end (or dies): then the store ends with this process."""
        self.channel.send({"port": self.store.port})
        while self.channel.open:
            for request in self.channel.requests(1.0):
                self.channel.send(self.answer(request))

    def answer(self, request):
        try:
            if request["op"] == "check":
                return {"result": bool(self.store.check(request["keys"]))}
            self.store.set(request["key"], request["value"])
            return {"result": None}
        except Exception as exc:  # the launcher raises it
            return {"error": f"{type(exc).__name__}: {exc}"}


def _refusal(sitecustomize):
    if sitecustomize is None or os.environ.get(SITECUSTOMIZE_VAR) == "worker":
        return None
    return (f"{sitecustomize.origin} (a sitecustomize module) would run once before the fork instead of in each worker "
            f"(set {SITECUSTOMIZE_VAR}=worker if it may run in each worker after the preloaded imports)")


def _become_worker_or_exit(server, request, sitecustomize):
    try:
        server.become_worker(request)
    except BaseException:  # a child that cannot take its worker's settings must not run as one
        traceback.print_exc()
        os._exit(1)
    _run_sitecustomize(sitecustomize)


def _main():
    channel = os.environ.pop(CHANNEL_VAR, None)
    try:
        _drop_this_directory()
        sitecustomize = _shadowed_sitecustomize()
    except BaseException:
        if channel is None:
            raise
        traceback.print_exc()  # the preload process must never go on to run the command's script
        os._exit(1)
    if channel is None:
        _run_sitecustomize(sitecustomize)
    else:
        _serve(channel, sitecustomize)


_main()

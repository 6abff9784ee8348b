"""The grammar compiler's worker processes, the parent's side: xgrammar cannot interrupt a compilation, so each
constraint is first compiled in a child process that is killed at the time limit (`grammar_compiler.py` drives
them; the children's side, the zygote's and the workers' loops, is `grammar_zygote.py`).

One *zygote* per process is started on the first constrained request (`python -P -m kiln.runtime.sampling.grammar_zygote`:
a fresh interpreter, so neither the server's threads nor its main module come along). It imports xgrammar (which
imports torch: 2 to 4 s on the dev machine) once, holds each compiler's `TokenizerInfo`, and forks workers on
demand (tens of milliseconds), so a worker killed at the limit is replaced at once. A worker compiles a constraint
and checks that its grammar allows something at the start; it answers how the compilation went, not the grammar:
moving a `CompiledGrammar` between processes (`serialize_json` / `deserialize_json`) costs more than compiling it
again (measured on kiln-tiny-code: a small schema 16 ms to compile, 13 + 3 ms to move; 30 string properties
with patterns 0.97 s to compile, 1.1 + 0.2 s to move; 10,000 choices 2.0 s to compile, 7.1 + 2.0 s to move, 35 MB
of JSON), so the parent compiles a constraint that a worker showed to be fine once more, itself.

Parent and children talk over Unix stream sockets: length-prefixed pickles; the zygote gets each new worker's
socket through SCM_RIGHTS. Everything ends when the parent closes its sockets (or dies): the zygote and idle
workers read end-of-file and exit. Linux only (fork, fd passing), like the rest of the runtime.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LENGTH = struct.Struct("<Q")
_SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()  # the child must not import from the caller's cwd
_ZYGOTE_MODULE = f"{__package__}.grammar_zygote"  # the zygote's main module (the children's side)
# Starting the zygote imports torch: seconds, more on a loaded machine. Not counted against any constraint.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CheckResult:
    """How a worker's compilation went. `status`: "ok", "invalid" (xgrammar refused it: `detail` is its
    message), "empty" (the grammar allows no token at the start and cannot end there either), "timeout" (killed
    at the limit) or "crashed" (the worker died: a crash inside xgrammar, or killed by the system)."""

    status: str
    detail: str = ""
    seconds: float = 0.0


class WorkerUnavailable(RuntimeError):
    """The zygote could not be started (not the constraint's fault)."""


def compile_source(compiler, method: str, text: str, any_whitespace: bool):
    """Compiles with an `xgr.GrammarCompiler`; `method` is "json_schema", "json_object", "regex" or "ebnf". The
    one place that maps a constraint to xgrammar's calls, used by the workers and by the parent alike."""
    if method == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if method == "json_object":
        # xgrammar's builtin JSON grammar also allows a top-level array; a non-strict object schema is exactly
        # "any JSON object" (any keys, any values).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
    if method == "regex":
        return compiler.compile_regex(text)
    if method == "ebnf":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar source {method!r}")


# ---- framing (both sides) ----------------------------------------------------------------------------
def send_message(sock: socket.socket, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.settimeout(None)  # a timeout left from the last read must not cut a write short
    sock.sendall(LENGTH.pack(len(data)) + data)


def receive_message(sock: socket.socket, deadline: float | None = None) -> object:
    """The next message; ConnectionError at end-of-file, TimeoutError past `deadline` (time.monotonic)."""
    (length,) = LENGTH.unpack(read_exact(sock, LENGTH.size, deadline))
    return pickle.loads(read_exact(sock, length, deadline))


def read_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    """`size` bytes; ConnectionError at end-of-file, TimeoutError past `deadline` (time.monotonic)."""
    chunks, remaining = [], size
    while remaining:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        chunk = sock.recv(min(remaining, 1 << 20))  # TimeoutError (socket.timeout) past the deadline
        if not chunk:
            raise ConnectionError("the other end closed the socket")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


# ---- the parent's side ---------------------------------------------------------------------------------
class _Worker:
    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid = sock, pid

    def kill(self) -> None:
        """Ends a worker that is still running (busy past its limit). Its pid cannot have been reused: the
        zygote reaps a worker only after it has exited, which a worker does only when its socket closes, which
        only we do (or when it dies, which the caller sees as end-of-file and answers with `close` instead)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


class WorkerPool:
    """Worker processes for one tokenizer, forked on first use; thread-safe. The caller bounds how many
    `check` calls run at once (the compiler's slots); each takes an idle worker or forks a new one."""

    def __init__(self, tokenizer_info_json: Callable[[], str], max_threads: int) -> None:
        """`tokenizer_info_json` makes `xgr.TokenizerInfo.serialize_json()` of the parent's tokenizer info (called
        on the first fork: it costs time for large vocabularies)."""
        self._tokenizer_info_json = tokenizer_info_json
        self._max_threads = max_threads
        self._key = next(_POOL_KEYS)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False

    def check(self, method: str, text: str, any_whitespace: bool, time_limit: float) -> CheckResult:
        """Compiles the constraint in a worker, which is killed once it has taken `time_limit` seconds. Raises
        WorkerUnavailable when no worker can be started."""
        for attempt in range(2):
            worker = self._take()
            try:
                send_message(worker.sock, ("compile", method, text, any_whitespace))
                break
            except OSError:  # an idle worker that died meanwhile (killed by the system): try a fresh one
                worker.close()
                if attempt:
                    return CheckResult("crashed", "its worker process ended")
        started = time.monotonic()
        try:
            reply = receive_message(worker.sock, started + time_limit)
        except TimeoutError:
            worker.kill()
            return CheckResult("timeout", seconds=time.monotonic() - started)
        except (ConnectionError, OSError, EOFError, pickle.UnpicklingError):  # it died (a crash, the OOM killer)
            worker.close()
            return CheckResult("crashed", "its worker process ended", time.monotonic() - started)
        self._give_back(worker)
        status, detail, seconds = reply
        return CheckResult(status, detail, seconds)

    def close(self) -> None:
        """Ends the idle workers (they exit on end-of-file) and lets the zygote go when no other pool uses it;
        later checks raise WorkerUnavailable."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.sock.close()
        _ZYGOTE.forget(self._key)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise WorkerUnavailable("the grammar compiler was closed")
            if self._idle:
                return self._idle.pop()
        return _ZYGOTE.fork(self._key, self._tokenizer_info_json, self._max_threads)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.sock.close()


class _Zygote:
    """The parent's handle on its one zygote, shared by every WorkerPool of the process (each engine has one):
    the zygote's start (importing xgrammar) is paid once. It holds one TokenizerInfo per pool that has forked,
    and stops when the last of them is forgotten."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._keys: set[int] = set()  # pools whose tokenizer the zygote holds
        self._forgotten: list[int] = []  # pools closed, not yet dropped (list.append is atomic)

    def fork(self, key: int, tokenizer_info_json: Callable[[], str], max_threads: int) -> _Worker:
        with self._lock:
            try:
                return self._fork_locked(key, tokenizer_info_json, max_threads)
            finally:
                self._forget_pending()

    def _fork_locked(self, key: int, tokenizer_info_json: Callable[[], str], max_threads: int) -> _Worker:
        for attempt in range(2):  # a zygote that died (killed by the system) is started once more
            try:
                if self._process is None:
                    self._start()
                if key not in self._keys:
                    self._request(("tokenizer", key, tokenizer_info_json()))
                    self._keys.add(key)
                return self._fork(key, max_threads)
            except (OSError, ConnectionError, TimeoutError, EOFError) as e:
                self._stop()
                if attempt:
                    raise WorkerUnavailable(f"cannot start a grammar compiler worker ({type(e).__name__}: "
                                            f"{e}); see the error output above") from None
        raise AssertionError("unreachable")

    def forget(self, key: int) -> None:
        """Drops a pool's tokenizer, and the zygote with the last one. Called from finalizers, so possibly by the
        garbage collector inside `fork` on this very thread: it never waits for the lock; whoever holds it
        finishes the job."""
        self._forgotten.append(key)
        if self._lock.acquire(blocking=False):
            try:
                self._forget_pending()
            finally:
                self._lock.release()

    def _forget_pending(self) -> None:
        while self._forgotten:
            key = self._forgotten.pop()
            if key not in self._keys:
                continue
            self._keys.discard(key)
            if not self._keys:
                self._stop()
                continue
            try:
                send_message(self._control, ("forget", key))
            except OSError:
                self._stop()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = subprocess.Popen(
                [sys.executable, *_SAFE_PATH, "-m", _ZYGOTE_MODULE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # stderr stays: a crash says why there
        except OSError as e:
            ours.close()
            raise WorkerUnavailable(f"cannot start the grammar compiler process: {e}") from None
        finally:
            theirs.close()
        self._control = ours
        self._keys.clear()
        self._expect_ready(receive_message(ours, time.monotonic() + START_TIMEOUT_S))

    def _request(self, message: object) -> None:
        send_message(self._control, message)
        self._expect_ready(receive_message(self._control, time.monotonic() + START_TIMEOUT_S))

    def _expect_ready(self, reply: object) -> None:
        if reply != ("ready",):
            self._stop()
            raise WorkerUnavailable(f"the grammar compiler process failed: {reply[1]}")

    def _fork(self, key: int, max_threads: int) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            data = pickle.dumps(("fork", key, max_threads), protocol=pickle.HIGHEST_PROTOCOL)
            socket.send_fds(self._control, [LENGTH.pack(len(data)) + data], [theirs.fileno()])
        finally:
            theirs.close()
        try:
            (pid,) = receive_message(self._control, time.monotonic() + START_TIMEOUT_S)
            worker = _Worker(ours, pid)
            # The worker says when its own xgrammar compiler is made, so a time limit counts compiling only.
            if receive_message(ours, time.monotonic() + START_TIMEOUT_S) != ("ready",):
                raise ConnectionError("the worker did not start")
        except BaseException:
            ours.close()
            raise
        return worker

    def _stop(self) -> None:
        self._keys.clear()
        if self._control is not None:
            self._control.close()  # the zygote exits at end-of-file
            self._control = None
        if self._process is not None:
            try:
                self._process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


_ZYGOTE = _Zygote()
_POOL_KEYS = itertools.count()

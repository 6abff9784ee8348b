"""The grammar compiler's child processes: the zygote's loop (this module is its main module, started by
`grammar_worker.py`, the parent's side, whose docstring tells the whole design) and the loop of each worker it
forks, which compiles a constraint and answers how that went. Importing it costs only the standard library and
`grammar_worker` (its framing): the zygote imports xgrammar, and torch with it, once it runs."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import time

from kiln.runtime.sampling.grammar_worker import (
    LENGTH,
    compile_source,
    read_exact,
    receive_message,
    send_message,
)


def _zygote_main(control_fd: int) -> None:
    control = socket.socket(fileno=control_fd)
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # a constraint that eats memory must cost the kernel's OOM killer a worker, not the server
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    try:
        import xgrammar as xgr
    except Exception as e:
        send_message(control, ("error", f"cannot import xgrammar: {type(e).__name__}: {e}"))
        return
    send_message(control, ("ready",))
    tokenizers = {}  # pool key -> xgr.TokenizerInfo
    # Workers are reaped here, never left to init: in a container the server itself may be process 1, and it
    # reaps no strangers. Until reaped a worker's pid cannot be reused, so the parent may still kill it.
    workers: set[int] = set()
    try:
        while True:
            try:  # every message's first bytes come with the new worker's socket, if it has one
                header, fds, _, _ = socket.recv_fds(control, LENGTH.size, 1)
                if not header:
                    return  # the parent has gone
                (length,) = LENGTH.unpack(header + read_exact(control, LENGTH.size - len(header), None))
                message = pickle.loads(read_exact(control, length, None))
            except (OSError, ConnectionError):
                return
            _reap(workers, block=False)
            if message[0] == "tokenizer":
                try:
                    tokenizers[message[1]] = xgr.TokenizerInfo.deserialize_json(message[2])
                except Exception as e:
                    send_message(control, ("error", f"cannot load the tokenizer: {type(e).__name__}: {e}"))
                    continue
                send_message(control, ("ready",))
            elif message[0] == "forget":
                tokenizers.pop(message[1], None)
            elif message[0] == "fork" and fds:
                zygote = os.getpid()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        control.close()
                        _die_with(zygote)
                        _worker_main(socket.socket(fileno=fds[0]), tokenizers[message[1]], message[2])
                        code = 0
                    finally:
                        os._exit(code)  # never return into the zygote's loop
                workers.add(pid)
                os.close(fds[0])
                send_message(control, (pid,))
    finally:  # the parent has gone or let us go: so do the workers, a busy one included
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(workers, block=True)


def _reap(workers: set[int], block: bool) -> None:
    """Collects the workers that have exited (all of them, waiting, with `block`)."""
    for pid in list(workers):
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            workers.discard(pid)


def _die_with(parent: int) -> None:
    """Has the kernel kill this process when `parent` (the zygote, which exits once the server is gone) ends, so
    a worker busy with a long compilation does not outlive the server."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the call
        os._exit(1)


def _worker_main(sock: socket.socket, tokenizer_info, max_threads: int) -> None:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
    send_message(sock, ("ready",))
    while True:
        try:
            _, method, text, any_whitespace = receive_message(sock)
        except ConnectionError:
            return
        started = time.perf_counter()
        try:
            grammar = compile_source(compiler, method, text, any_whitespace)
        except Exception as e:  # xgrammar raises RuntimeError (and sometimes ValueError) for bad input
            send_message(sock, ("invalid", str(e) or type(e).__name__, time.perf_counter() - started))
            continue
        seconds = time.perf_counter() - started
        # Nothing allowed at the start (a rule or $ref that only reaches itself): the sampler would see an empty
        # mask. Stop tokens are in the mask where the grammar may end, so an empty mask also means it cannot end.
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, tokenizer_info.vocab_size)  # [1, W] int32
        matcher.fill_next_token_bitmask(bitmask, 0)
        empty = not bool(bitmask.any()) and not matcher.is_completed()
        send_message(sock, ("empty" if empty else "ok", "", seconds))


if __name__ == "__main__":
    _zygote_main(int(sys.argv[1]))
    os._exit(0)  # nothing to tidy up, and tearing down torch's modules takes a second

"""Prompt work off the event loop and the engine thread: tokenizing, chat templating and decoding large texts.

Tokenizing a 7.8 MB prompt took 70 s and 4.9 GB: on the event loop it stalled every stream and health check,
on the engine thread every running request. The servers hand such work to a `PromptWorker`, a small thread pool
that EngineService owns (Hugging Face's fast tokenizers release the GIL while they encode, so the loop keeps
running; pure-Python work such as a Jinja template shares the GIL in 5 ms slices). After work on a large text the
worker gives the heap that the tokenizer freed back to the operating system (glibc's `malloc_trim`): otherwise
the process stays at its peak memory after a single large request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("kiln.serve")

T = TypeVar("T")

# Text of at least this many characters is "large": after working on it the worker returns freed memory.
LARGE_TEXT_CHARS = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Returns the C heap's free pages to the operating system (a no-op without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class PromptWorker:
    """Runs prompt work (tokenizing, templating, decoding) in its own few threads, never on the event loop.

    Work cannot be interrupted once started: a request whose client leaves still finishes its tokenization,
    which the character cap (--max-prompt-chars) keeps short."""

    def __init__(self, max_workers: int | None = None) -> None:
        # Two or more: a small prompt need not wait behind a large one; more than the cores buys nothing.
        workers = max_workers or max(2, min(4, os.cpu_count() or 1))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kiln-prompt")

    async def run(self, fn: Callable[..., T], *args, size: int = 0) -> T:
        """`fn(*args)` in a worker thread; `size`: the characters of text it works on, which decides whether
        memory is handed back afterwards."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            if size >= LARGE_TEXT_CHARS:
                # Queued behind the work (done by now): the tokenizer's buffers are freed; trimming takes
                # milliseconds, but it walks the whole heap, so not on the loop either.
                self._pool.submit(release_memory)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

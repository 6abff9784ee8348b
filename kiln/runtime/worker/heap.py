"""The garbage collector's view of a ready engine.

Serving allocates container objects at a high rate (per request and step: token lists, outputs, schedule rows),
so Python's collector runs its full (oldest-generation) pass every second or so under load; that pass walks
every tracked object in the process: torch's and transformers' modules, the tokenizer, the engine's own
tables: ~100-150 ms each on a loaded server, during which no step is launched (an H200 serving an 8B FP8 engine at
batch 1024 lost 16% of its throughput to them). What exists when the engine is ready lives as long as the
engine, so it is frozen out of the collector's passes (`gc.freeze`, as vLLM does); objects made while serving
are collected as before, and frozen ones still go when their last reference does. A frozen cycle waits for
`gc.unfreeze`: each new engine thaws the heap first, so an earlier engine dropped as cyclic garbage (a notebook's
`del llm`, a test's) is collected then rather than never; and the heap is thawed at exit, so the interpreter's last
collections still free it (frozen, native extensions' objects outlive them: nanobind reports Triton's as leaked).
"""

from __future__ import annotations

import atexit
import gc

_thaw_at_exit: list[bool] = []  # registered once a process


def freeze_startup_heap() -> int:
    """Collects what startup (and any engine before it) left behind, then moves every object now alive out of the
    collector's passes; returns how many objects are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit:
        atexit.register(gc.unfreeze)
        _thaw_at_exit.append(True)
    return gc.get_freeze_count()

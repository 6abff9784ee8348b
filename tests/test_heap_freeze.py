"""The ready engine's heap is frozen out of the collector's passes (runtime/worker/heap.py), and an engine
dropped as cyclic garbage is still collected when the next one starts."""

import gc
import weakref

from kiln.runtime import LLM
from kiln.runtime.worker.heap import freeze_startup_heap


def test_a_ready_engine_has_frozen_the_heap(tiny_code_engine):
    gc.unfreeze()
    with LLM(tiny_code_engine) as llm:
        assert gc.get_freeze_count() > 1000
        assert llm.generate(["def f():"])[0].outputs[0].token_ids


def test_frozen_cyclic_garbage_is_collected_when_the_next_heap_is_frozen():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    alive = weakref.ref(a)
    freeze_startup_heap()
    del a, b
    gc.collect()
    assert alive() is not None  # frozen: the collector does not see it
    freeze_startup_heap()
    assert alive() is None
    gc.unfreeze()


def test_the_heap_is_thawed_at_exit(tiny_code_engine):
    """Frozen objects outlive the interpreter's last collections: native extensions then report them leaked
    (nanobind prints Triton's IR objects at exit), so the heap is thawed at exit."""
    import subprocess
    import sys

    script = (f"from kiln.runtime import LLM\nllm = LLM({str(tiny_code_engine)!r})\n"
              "print(len(llm.generate(['def f():'])[0].outputs[0].token_ids))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr[-2000:]

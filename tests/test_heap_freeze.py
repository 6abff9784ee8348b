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

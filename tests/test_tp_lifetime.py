"""A tensor-parallel engine's lifetime in the caller's process: one dropped without shutdown() (a notebook's
`del llm`) stops its ranks and releases its process groups, and engines own their groups (none is torch's
default group), so a second engine starts after the first, or beside it, and gives the same tokens.

Each TP engine here starts a second process (rank 1) over gloo on the CPU, like tests/test_tp_runtime.py.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch.distributed as dist
from test_tp_runtime import GREEDY, PROMPTS, VARIANTS, build_pair, generate

from kiln.runtime import LLM

EXIT_WAIT_S = 5.0


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("tp-lifetime"), *VARIANTS["llama-gqa"])


@pytest.fixture(scope="module")
def expected(llama_pair):
    outs, _ = generate(llama_pair[0], PROMPTS, GREEDY)
    return [o.token_ids for o in outs]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = EXIT_WAIT_S) -> list[int]:
    """The pids still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_dropped_engine_stops_its_ranks_and_a_second_one_starts(llama_pair, expected):
    _, tp2 = llama_pair
    llm = LLM(tp2)
    assert tokens(llm) == expected
    pids = llm.engine.executor.worker_pids
    assert pids and all(alive(p) for p in pids)
    del llm  # no shutdown()
    gc.collect()
    assert wait_gone(pids) == []
    second = LLM(tp2)
    try:
        assert tokens(second) == expected
    finally:
        second.shutdown()


def test_engines_do_not_use_the_default_process_group(llama_pair):
    """torch.distributed's default group is the process's, one at a time: an engine that made it would stop
    the user's own init_process_group, and any second engine."""
    with LLM(llama_pair[1]):
        assert not dist.is_initialized()


def test_two_live_engines_in_one_process_give_the_tokens_of_one(llama_pair, expected):
    _, tp2 = llama_pair
    with LLM(tp2) as first, LLM(tp2) as second:
        assert set(first.engine.executor.worker_pids).isdisjoint(second.engine.executor.worker_pids)
        assert tokens(first) == expected
        assert tokens(second) == expected
        assert tokens(first) == expected  # the first still runs after the second's steps


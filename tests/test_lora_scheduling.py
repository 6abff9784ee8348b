"""LoRA adapters in the torch-free core: prefix-cache hashes keyed by adapter, at most `max_loras` distinct
adapters per step (kiln/runtime/core/scheduler.py, block_manager.py)."""

from __future__ import annotations

import pytest

from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.request import Request
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits

PROMPT = list(range(1, 34))  # two full blocks of 16 and one token


def test_prefix_blocks_are_keyed_by_adapter():
    bm = BlockManager(num_blocks=16, block_size=16)
    for request_id, lora_id in (("base", 0), ("a", 1)):
        bm.allocate(request_id, len(PROMPT))
        bm.cache_full_blocks(request_id, PROMPT, len(PROMPT), lora_id)
    assert bm.find_cached_prefix(PROMPT).num_tokens == 32
    assert bm.find_cached_prefix(PROMPT, 1).num_tokens == 32
    assert bm.find_cached_prefix(PROMPT, 2).num_tokens == 0  # another adapter shares nothing
    assert set(bm.find_cached_prefix(PROMPT).block_ids).isdisjoint(bm.find_cached_prefix(PROMPT, 1).block_ids)


def _request(request_id: str, lora_id: int) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), lora_int_id=lora_id)


@pytest.mark.parametrize("max_loras", [1, 2])
def test_a_step_runs_at_most_max_loras_adapters(max_loras):
    scheduler = Scheduler(SchedulerLimits(max_batch_size=8, max_num_tokens=64, max_loras=max_loras),
                          BlockManager(num_blocks=32, block_size=16))
    for i, lora_id in enumerate([1, 0, 2, 1, 3, 0]):
        scheduler.add_request(_request(f"r{i}", lora_id))
    seen = set()
    for _ in range(12):
        out = scheduler.schedule()
        adapters = {r.lora_int_id for r in out.requests} - {0}
        assert len(adapters) <= max_loras
        seen |= {r.request_id for r in out.requests}
        scheduler.update_after_step(out, {r.request_id: [7] for r in out.requests if r.sample})
        for r in out.requests:  # each request ends after one token: the queue moves on
            scheduler.finish_request(r.request_id, scheduler.get(r.request_id).status.FINISHED_LENGTH)
    assert seen == {f"r{i}" for i in range(6)}  # every request ran in the end


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")
    with pytest.raises(ValueError, match="max_loras=0"):
        SchedulerLimits(1, 1, max_loras=0)

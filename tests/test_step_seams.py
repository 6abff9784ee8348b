"""The seams later capabilities plug into: several sampled positions per request per step, accepted tokens
as lists with stop checks per token, prefix hashes over accepted tokens only, the executor and the engine
factory, the KV-cache object and the typed engine config."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kiln.engine_format import EngineBuildConfig, EngineError, Mapping
from kiln.model_defs import ModelConfig
from kiln.model_defs.config import RopeConfig
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.request import Request
from kiln.runtime.core.scheduler import ScheduledRequest, Scheduler, SchedulerLimits, SchedulerOutput
from kiln.runtime.engine.factory import create_engine
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.worker.executor import LocalExecutor
from kiln.runtime.worker.kv_cache import KVCache
from kiln.runtime.worker.model_step import StepInput, StepResult
from kiln.runtime.worker.step_inputs import pack_step

BS = 4


def _scheduler(num_blocks: int = 16) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerLimits(8, 64), bm), bm


def _verify_step(request: Request, drafts: list[int], bm: BlockManager) -> SchedulerOutput:
    """What a draft-verifying step looks like: the last accepted token plus the drafts, all sampled."""
    start = request.num_computed_tokens
    tokens = (request.all_token_ids[-1], *drafts)
    assert bm.allocate(request.request_id, start + len(tokens))
    item = ScheduledRequest(request.request_id, tokens, start, bm.block_table(request.request_id),
                            request.num_prompt_tokens, num_sampled=len(tokens))
    return SchedulerOutput((item,), ())


def test_rejected_draft_positions_roll_back_and_are_never_hashed():
    sched, bm = _scheduler()
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add_request(request)
    first = sched.schedule()
    assert first.requests[0].num_sampled == 1
    sched.update_after_step(first, {"a": [4]})
    assert (request.num_computed_tokens, request.output_token_ids) == (3, [4])

    # Drafts 5, 6, 7: 5 matches, 6 does not (the model says 42 there).
    step = _verify_step(request, [5, 6, 7], bm)
    sched.update_after_step(step, {"a": [5, 42]})
    assert request.output_token_ids == [4, 5, 42]
    assert request.num_computed_tokens == 5  # 3 + 4 computed - 2 rejected positions: tokens 4 and 5 are kept
    # Only the first block ([1, 2, 3, 4]) is full of accepted, computed tokens; [5, 6, 7, ...] never is cached.
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 4
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 42, 0, 0, 0]).num_tokens == 4

    # All three drafts match: the bonus token is the fourth accepted one.
    step = _verify_step(request, [43, 44, 45], bm)
    sched.update_after_step(step, {"a": [43, 44, 45, 46]})
    assert request.num_computed_tokens == 9 and request.output_token_ids == [4, 5, 42, 43, 44, 45, 46]
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 42, 43, 44, 0]).num_tokens == 8


def test_cache_full_blocks_never_hashes_past_the_known_tokens():
    bm = BlockManager(8, BS)
    assert bm.allocate("a", 12)
    bm.cache_full_blocks("a", [1, 2, 3, 4, 5, 6], 12)  # 12 positions computed, 6 of them accepted tokens
    assert bm.num_cached_blocks == 1


def test_pack_step_samples_the_last_num_sampled_positions_of_each_request():
    config = ModelConfig("LlamaForCausalLM", 32, 8, 16, 1, 2, 1, 4, 1e-6, 64, RopeConfig())
    cache = KVCache(config, 8, BS, torch.float32, torch.device("cpu"))
    step = SchedulerOutput((
        ScheduledRequest("a", (1, 2, 3), 0, (0,), 3, num_sampled=1),
        ScheduledRequest("b", (4, 5, 6, 7), 2, (1, 2), 2, num_sampled=0),  # a prefill chunk
        ScheduledRequest("c", (8, 9, 10), 5, (3, 4), 5, num_sampled=3),  # verifying two drafts
    ), ())
    packed = pack_step(step, BS, cache.layers, torch.device("cpu"))
    assert packed.sample_rows.tolist() == [2, 7, 8, 9]
    assert packed.logits_offsets == (0, 1, 1, 4)
    assert packed.context.seq_lens.tolist() == [3, 6, 8]
    assert packed.context.slot_mapping.tolist() == [0, 1, 2, 6, 7, 8, 9, 17, 18, 19]


def test_kv_cache_owns_one_allocation_with_per_layer_views_in_its_own_dtype():
    config = ModelConfig("LlamaForCausalLM", 32, 8, 16, 3, 2, 1, 4, 1e-6, 64, RopeConfig())
    cache = KVCache(config, 5, BS, torch.float16, torch.device("cpu"))
    assert len(cache.layers) == 3 and cache.layers[1][0].shape == (5, BS, 1, 4)
    assert all(k.dtype == torch.float16 and k.untyped_storage().data_ptr() == cache.storage.untyped_storage().data_ptr()
               for k, v in cache.layers)
    assert cache.nbytes == 5 * KVCache.bytes_per_block(config, BS, torch.float16) and cache.scales is None


class DuplicatingExecutor(LocalExecutor):
    """Samples every sampled position `copies` times (as if it verified copies-1 drafts that all match the
    greedy token), so the engine accepts several tokens per request per step."""

    def __init__(self, inner: LocalExecutor, copies: int) -> None:
        vars(self).update(vars(inner))
        self.copies = copies

    def execute(self, step: StepInput) -> StepResult:
        result = super().execute(step)
        rows = [j for i in range(len(result.request_ids)) for j in result.rows_of(i) for _ in range(self.copies)]
        offsets = tuple(self.copies * o for o in result.logits_offsets)
        return StepResult(result.logits[rows], result.request_ids, offsets, result.prompt_logprobs)


@pytest.fixture(scope="module")
def duplicating_llm(tiny_code_engine):
    llm = LLM(tiny_code_engine)
    engine = llm.engine
    engine.executor = DuplicatingExecutor(engine.executor, copies=3)
    return llm


def test_several_tokens_per_step_are_accepted_and_checked_one_by_one(duplicating_llm):
    llm = duplicating_llm
    greedy = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=True)
    out = llm.generate("def add(a, b):", greedy)[0]
    # Each step appends its greedy token three times; max_tokens cuts the last step's list at 7.
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and len(out.logprobs) == 7
    assert out.token_ids[:3] == [out.token_ids[0]] * 3
    # A stop token id in the middle of a step's list ends the request there, and it adds no text.
    stop_id = out.token_ids[3]
    stopped = llm.generate("def add(a, b):", dataclasses.replace(greedy, stop_token_ids=(stop_id,)))[0]
    assert stopped.token_ids == out.token_ids[:4] and stopped.finish_reason == "stop"
    # A stop string completed by the first of a step's tokens drops the two after it.
    text = llm.tokenizer.decode(out.token_ids[:3])
    by_text = llm.generate("def add(a, b):", dataclasses.replace(greedy, stop=(text,)))[0]
    assert by_text.finish_reason == "stop" and len(by_text.token_ids) <= 3 and len(by_text.logprobs) == len(by_text.token_ids)
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_create_engine_builds_the_local_executor(tiny_code_engine):
    engine = create_engine(tiny_code_engine, RuntimeOptions(num_kv_blocks=7))
    assert isinstance(engine.executor, LocalExecutor)
    assert engine.runtime.num_kv_blocks == 7 == engine.block_manager.num_blocks
    assert engine.memory_report.num_kv_blocks == 7 and engine.runtime.cache_dtype == torch.float32


def _copy_engine(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    doc = json.loads((dst / "engine.json").read_text())
    change(doc)
    (dst / "engine.json").write_text(json.dumps(doc))
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda d: d["build_config"].pop("max_seq_len"), "build_config: missing key(s) max_seq_len"),
    (lambda d: d["build_config"].update(max_seq_len="abc"), "build_config: max_seq_len='abc' must be a positive integer"),
    (lambda d: d["build_config"].update(kv_cache_dtype="float8"), "kv_cache_dtype='float8' must be one of"),
    (lambda d: d["mapping"].update(tp_size=2), "mapping: num_ranks=1 must equal tp_size=2"),
])
def test_engine_json_that_lies_is_refused_naming_file_and_key(tiny_code_engine, tmp_path, change, message):
    engine = _copy_engine(tiny_code_engine, tmp_path / "engine", change)
    with pytest.raises(EngineError) as info:
        LLM(engine)
    assert message in str(info.value) and "engine.json" in str(info.value)


def test_engine_build_config_and_mapping_round_trip():
    build = EngineBuildConfig("bfloat16", 8, 256, 1024, 16, "bfloat16")
    assert EngineBuildConfig.from_dict(build.to_dict()) == build and build.torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown key"):
        EngineBuildConfig.from_dict({**build.to_dict(), "typo": 1})
    mapping = Mapping(tp_size=2)
    assert Mapping.from_dict(mapping.to_dict()) == mapping and mapping.for_rank(1).tp_rank == 1
    with pytest.raises(ValueError, match="tp_rank"):
        Mapping(tp_size=2, tp_rank=2)

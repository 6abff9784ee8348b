"""LoRA adapters through the runtime: `LLM(..., enable_lora=True).generate(..., lora_request=...)`.

Two real PEFT adapters on the bundled kiln-tiny-code (ranks 8 and 16, different target modules, each a short
fine-tune on a different slice of kiln's code, so that they visibly change the output) and the base model, mixed in one generate call: kiln's greedy tokens
and logprobs per adapter equal PEFT's model in float32, also with a tight KV cache (preemption), small steps
(chunked prefill), and fewer device slots than adapters; adapters never share prefix-cache blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from lora_util import peft_greedy, train_adapter

from kiln.runtime import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def add(a, b):\n    return", "# read a file\nwith open(",
           "def main():\n    args = ", "try:\n    import numpy", "x = [i * i for i in", "@dataclass\nclass Point:\n",
           "def is_prime(n):\n    if n <", "import json\n\ndef load(path):\n"]  # a dozen
MAX_TOKENS = 8


def _code(part: int) -> str:
    """6,000 characters of the held-out code sample to fine-tune an adapter on: a text that never changes (kiln's
    own source did, and a new adapter may then make EOS the greedy token, which transformers' min_new_tokens masks
    and ignore_eos does not)."""
    return (BUNDLED.parent / "heldout-sample.txt").read_text()[6000 * part:6000 * (part + 1)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(adapter dirs by id, expected (tokens, logprobs) per (prompt, id); id 0 is the base model)."""
    root = tmp_path_factory.mktemp("lora-runtime")
    base = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    dirs = {1: train_adapter(base, root / "a8", _code(0), r=8, lora_alpha=16,
                             target_modules=["q_proj", "v_proj", "down_proj"]),
            2: train_adapter(base, root / "a16", _code(1), r=16, lora_alpha=8, use_rslora=True,
                             target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])}
    tokenizer = transformers.AutoTokenizer.from_pretrained(BUNDLED)
    return dirs, peft_greedy(base, dirs, PROMPTS, tokenizer, MAX_TOKENS)


def _requests(dirs) -> dict[int, LoRARequest | None]:
    return {0: None, 1: LoRARequest("a8", 1, str(dirs[1])), 2: LoRARequest("a16", 2, str(dirs[2]))}


def _check_mixed(llm: LLM, dirs, expected) -> None:
    loras = _requests(dirs)
    cases = [(p, lora_id) for p in range(len(PROMPTS)) for lora_id in (0, 1, 2)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = llm.generate([PROMPTS[p] for p, _ in cases], params, [loras[i] for _, i in cases])
    for (p, lora_id), out in zip(cases, outs):
        tokens, logprobs = expected[p, lora_id]
        assert out.token_ids == tokens, (p, lora_id)
        assert out.logprobs == pytest.approx(logprobs, abs=2e-3), (p, lora_id)
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("limits", [
    {},
    {"num_kv_blocks": 6, "max_num_tokens": 8},  # preemption and chunked prefill
    {"max_loras": 1},  # two adapters and the base model through one device slot
], ids=["plain", "tight", "one-slot"])
def test_adapters_and_base_in_one_batch_match_peft(tiny_code_engine, setup, limits):
    dirs, expected = setup
    with LLM(tiny_code_engine, enable_lora=True, max_lora_rank=16, **limits) as llm:
        _check_mixed(llm, dirs, expected)
        if "num_kv_blocks" in limits:
            assert llm.kv_cache_stats()["num_preemptions"] > 0
        if "max_loras" in limits:  # the adapters took turns in the slot
            assert llm.engine.executor.runner.lora.num_loads > 2


def test_adapters_never_share_prefix_blocks(tiny_code_engine, setup):
    dirs, _ = setup
    loras = _requests(dirs)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(tiny_code_engine, enable_lora=True) as llm:
        llm.generate(prompt, params, loras[1])
        hits = llm.kv_cache_stats()["prefix_cache_hit_tokens"]
        llm.generate(prompt, params, loras[2])  # another adapter: nothing reused
        llm.generate(prompt, params)  # the base model: nothing reused
        assert llm.kv_cache_stats()["prefix_cache_hit_tokens"] == hits
        llm.generate(prompt, params, loras[1])  # the same adapter again: its blocks are reused
        assert llm.kv_cache_stats()["prefix_cache_hit_tokens"] > hits


def test_refusals(tiny_code_engine, setup, tmp_path):
    dirs, _ = setup
    loras = _requests(dirs)
    with LLM(tiny_code_engine) as llm, pytest.raises(ValueError, match="enable_lora"):
        llm.generate("x = 1", SamplingParams(max_tokens=1), loras[1])
    with LLM(tiny_code_engine, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match=r"'a16'.*max_lora_rank=8"):
            llm.generate("x = 1", SamplingParams(max_tokens=1), loras[2])
        with pytest.raises(ValueError, match="lora_int_id=1 already names"):
            llm.generate(["x = 1", "y = 2"], SamplingParams(max_tokens=1),
                         [loras[1], LoRARequest("other", 1, str(dirs[2]))])
        with pytest.raises(ValueError, match="2 lora_request entries for 1 prompts"):
            llm.generate("x = 1", SamplingParams(max_tokens=1), [loras[1], None])
        assert llm.kv_cache_stats()["num_waiting"] == 0
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("x", 0, "/nowhere")
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        LLM(tiny_code_engine, enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_async_llm_passes_the_adapter_through(tiny_code_engine, setup):
    import asyncio

    from kiln.runtime import AsyncLLM

    dirs, expected = setup
    loras = _requests(dirs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = AsyncLLM(tiny_code_engine, enable_lora=True, async_scheduling=True)

    async def run(prompt, lora):
        return [out async for out in llm.generate(prompt, params, lora_request=lora)][-1].token_ids

    async def main():
        return await asyncio.gather(*(run(PROMPTS[p], loras[i]) for p in (0, 1) for i in (0, 1, 2)))

    try:
        assert asyncio.run(main()) == [expected[p, i][0] for p in (0, 1) for i in (0, 1, 2)]
    finally:
        llm.shutdown()


def test_host_memory_never_evicts_a_pinned_adapter():
    """Adapters of live requests stay in host memory past max_cpu_loras; the others go, least recently used
    first, once no request pins them (LoRASlots without a network: nothing is put into a slot here)."""
    from kiln.runtime.worker.lora_slots import LoRASlots

    slots = LoRASlots(torch.nn.Module(), None, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                      device=torch.device("cpu"), dtype=torch.float32)
    for lora_id in (1, 2, 3):  # handed over already read: nothing is read from disk here
        slots.register(LoRARequest(f"a{lora_id}", lora_id, f"/a{lora_id}"), f"adapter {lora_id}")
        slots.pin(lora_id)
    assert all(slots.holds(i) for i in (1, 2, 3))  # all pinned: over max_cpu_loras=1
    slots.pin(2)  # a second request on adapter 2
    slots.unpin(1)
    assert not slots.holds(1) and slots.holds(2) and slots.holds(3)
    slots.unpin(2)
    slots.unpin(3)
    assert slots.holds(2) and not slots.holds(3)  # 2 is still pinned once and fills the one place
    slots.unpin(2)
    assert slots.holds(2)  # within max_cpu_loras: kept for the next request
    slots.register(LoRARequest("a4", 4, "/a4"), "adapter 4")
    slots.pin(4)
    assert not slots.holds(2) and slots.holds(4)  # the least recently used unpinned one went
    slots.unpin(4)
    assert slots.stats() == {"slot_loads": 0, "disk_reads": 0, "host_adapters": 1, "pinned_adapters": 0,
                             "device_slots": 1}


def test_more_adapters_than_slots_and_host_memory_in_flight(tiny_code_engine, setup):
    """Three adapters at once through one device slot and one host place: each read once (pinned while its
    requests live, never read again before a step), each request with PEFT's tokens."""
    dirs, expected = setup
    loras = {**_requests(dirs), 3: LoRARequest("a8-again", 3, str(dirs[1]))}  # another id: another adapter
    cases = [(p, lora_id) for p in range(2) for lora_id in (1, 2, 3, 0)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(tiny_code_engine, enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=1) as llm:
        outs = llm.generate([PROMPTS[p] for p, _ in cases], params, [loras[i] for _, i in cases])
        for (p, lora_id), out in zip(cases, outs):
            assert out.token_ids == expected[p, 1 if lora_id == 3 else lora_id][0], (p, lora_id)
        stats = llm.lora_stats()
        assert stats["disk_reads"] == 3 and stats["slot_loads"] >= 3
        assert stats["pinned_adapters"] == 0 and stats["host_adapters"] == 1  # the bound again once idle
        assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]


def test_async_llm_reads_adapters_off_the_engine_thread(tiny_code_engine, setup, monkeypatch):
    """AsyncLLM reads an adapter on a worker thread before the engine sees the request: a read that blocks
    stalls nobody else (base-model requests stream meanwhile), a bad adapter is refused there with the
    engine's message, and more adapters than max_loras and max_cpu_loras in flight all finish right."""
    import asyncio
    import threading

    from kiln.runtime import AsyncLLM
    from kiln.runtime.engine import lora_admission

    dirs, expected = setup
    loras = {**_requests(dirs), 3: LoRARequest("a8-again", 3, str(dirs[1]))}
    gate, reading = threading.Event(), threading.Event()
    readers: list[str] = []
    real = lora_admission.read_lora_adapter

    def read(*args, **kwargs):
        readers.append(threading.current_thread().name)
        if kwargs["name"] == "a8":  # held until the base model has streamed
            reading.set()
            assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_admission, "read_lora_adapter", read)
    llm = AsyncLLM(tiny_code_engine, enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def run(p, lora_id):
        outs = [out async for out in llm.generate(PROMPTS[p], params, lora_request=loras[lora_id])]
        return len(outs), outs[-1].token_ids

    async def main():
        held = asyncio.create_task(run(0, 1))
        assert await asyncio.to_thread(reading.wait, 30)
        streamed, tokens = await asyncio.wait_for(run(1, 0), 30)  # while the read of a8 is held
        assert streamed > 1 and tokens == expected[1, 0][0] and not held.done()
        with pytest.raises(ValueError, match=r"LoRA adapter 'gone' \(lora_int_id=9, /nowhere\)"):
            await anext(llm.generate("x", params, lora_request=LoRARequest("gone", 9, "/nowhere")))
        rest = [asyncio.create_task(run(p, i)) for p in (1, 2) for i in (1, 2, 3)]
        gate.set()
        return await held, await asyncio.gather(*rest)

    try:
        (_, first), rest = asyncio.run(main())
        assert first == expected[0, 1][0]
        assert [tokens for _, tokens in rest] == [expected[p, 1 if i == 3 else i][0] for p in (1, 2) for i in (1, 2, 3)]
        assert "kiln-engine" not in readers
        assert llm.lora_stats()["disk_reads"] == 0  # the engine thread read nothing
    finally:
        gate.set()
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adapters_on_cuda_match_peft(setup, tmp_path):
    """The CUDA path (the Triton lora_add kernel, decode steps and lone prefills in CUDA graphs that read the rows'
    adapter slots): the same tokens as PEFT, mixed in one batch and one request at a time."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    dirs, expected = setup
    engine = build_engine(BUNDLED, tmp_path / "cuda", BuildConfig(device="cuda", dtype="float32", max_batch_size=32),
                          progress=False)
    with LLM(engine, enable_lora=True, max_lora_rank=16, max_loras=2) as llm:
        runner = llm.engine.executor.runner
        assert runner.graphs is not None and runner.prefill_graphs is not None
        _check_mixed(llm, dirs, expected)
        loras = _requests(dirs)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
        for lora_id in (2, 0, 1):  # alone: its prefill replays a prefill graph, its decode steps a decode graph
            for p, prompt in enumerate(PROMPTS[:2]):
                out = llm.generate([prompt], params, loras[lora_id])[0]
                assert out.token_ids == expected[p, lora_id][0], (p, lora_id)
                assert out.logprobs == pytest.approx(expected[p, lora_id][1], abs=2e-3), (p, lora_id)

"""LoRA adapters through the runtime: `LLM(..., enable_lora=True).generate(..., lora_request=...)`.

Two real PEFT adapters on the bundled kiln-tiny-code (ranks 8 and 16, different target modules, random lora_B
so that they visibly change the output) and the base model, mixed in one generate call: kiln's greedy tokens
and logprobs per adapter equal PEFT's model in float32, also with a tight KV cache (preemption), small steps
(chunked prefill), and fewer device slots than adapters; adapters never share prefix-cache blocks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from lora_util import make_adapter

from kiln.runtime import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def add(a, b):\n    return", "# read a file\nwith open("]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(adapter dirs by id, expected (tokens, logprobs) per (prompt, id); id 0 is the base model)."""
    root = tmp_path_factory.mktemp("lora-runtime")
    base = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    dirs = {1: make_adapter(base, root / "a8", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])[0],
            2: make_adapter(base, root / "a16", 2, r=16, lora_alpha=8, use_rslora=True,
                            target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])[0]}
    tokenizer = transformers.AutoTokenizer.from_pretrained(BUNDLED)
    expected = {}
    for lora_id in (0, 1, 2):
        model = base if lora_id == 0 else peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs[lora_id]).eval()
        for p, prompt in enumerate(PROMPTS):
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     min_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]  # raw: min_new_tokens masks EOS in scores
            expected[p, lora_id] = (tokens, logprobs)
    # The adapters must change what is generated, else the comparison proves nothing.
    assert any(expected[p, 1][0] != expected[p, 0][0] for p in range(len(PROMPTS)))
    assert any(expected[p, 2][0] != expected[p, 0][0] for p in range(len(PROMPTS)))
    return dirs, expected


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adapters_on_cuda_match_peft(setup, tmp_path):
    """The CUDA path (the Triton lora_add kernel, steps run eagerly while LoRA is on): the same tokens as PEFT."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    dirs, expected = setup
    engine = build_engine(BUNDLED, tmp_path / "cuda", BuildConfig(device="cuda", dtype="float32", max_batch_size=32),
                          progress=False)
    with LLM(engine, enable_lora=True, max_lora_rank=16, max_loras=2) as llm:
        _check_mixed(llm, dirs, expected)

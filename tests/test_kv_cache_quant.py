"""FP8 and INT8 KV caches (TensorRT-LLM's semantics) on the CPU reference path: a key k is stored as
quantize(k / k_scale) and read as stored.float() * k_scale, with one (k_scale, v_scale) pair per layer from
engine.json's build_config. Ops against a hand-quantized float32 computation, argument and config checks,
the FP8 load-time refusal on pre-Ada GPUs, and whole engines against their float twin."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import shutil

import pytest
import torch
from model_factory import make_checkpoint, make_engine

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import EngineBuildConfig, EngineError
from kiln.engine_format.config import KV_CACHE_DTYPES
from kiln.model_defs import ModelConfig
from kiln.model_defs.config import RopeConfig
from kiln.plugins import paged_attention, rotary_embedding, rotary_embedding_and_write_kv, write_kv_cache
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.engine.factory import create_executor
from kiln.runtime.worker.device_support import check_device_supports
from kiln.runtime.worker.engine_loader import load_engine_info, resolve_runtime
from kiln.runtime.worker.kv_cache import KVCache

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
QUANT_DTYPES = [torch.float8_e4m3fn, torch.int8]
IDS = ["fp8", "int8"]


def _quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the cache should hold, written out by hand from the semantics."""
    if dtype == torch.int8:
        return torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.abs().amax().float() / QMAX[dtype]).reshape(1)  # [1] float32, calibrated on x itself


def _plain_attention(q, k, v, scale):
    # q: [n, Hq, D], the last n of L positions; k, v: [L, Hk, D] float32 -> [n, Hq, D]: softmax by hand
    n, heads, _ = q.shape
    length = k.shape[0]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, n, L]
    causal = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _layout(lengths, block_size, num_blocks, seed=0):
    """Random disjoint block tables and the slot of every position of every sequence."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    slots = [[t[p // block_size] * block_size + p % block_size for p in range(n)]
             for t, n in zip(tables, lengths)]
    return tables, slots


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_write_then_attend_matches_float_attention_over_the_same_quantized_values(dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 24
    seqs = [(9, 1), (0, 7), (13, 1), (5, 4)]  # (cached, new): decodes among prefill chunks
    lengths = [c + n for c, n in seqs]
    tables, slots = _layout(lengths, block_size, num_blocks)
    keys = [torch.randn(n, kv_heads, dim) * 3 for n in lengths]
    values = [torch.randn(n, kv_heads, dim) for n in lengths]
    k_all, v_all = torch.cat(keys), torch.cat(values)
    k_scale, v_scale = _scale(k_all, dtype), _scale(v_all, dtype)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # One write of every token, with a padding row (slot -1) that must write nothing.
    slot_mapping = torch.tensor([s for ss in slots for s in ss] + [-1])
    pad = torch.full((1, kv_heads, dim), 1e4)
    write_kv_cache(torch.cat([k_all, pad]), torch.cat([v_all, pad]), k_cache, v_cache, slot_mapping,
                   k_scale, v_scale)

    k_q, v_q = _quantize(k_all, k_scale.item(), dtype), _quantize(v_all, v_scale.item(), dtype)
    flat = slot_mapping[:-1]
    assert torch.equal(k_cache.view(torch.uint8).view(-1, kv_heads, dim)[flat], k_q.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8).view(-1, kv_heads, dim)[flat], v_q.view(torch.uint8))
    touched = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    touched[flat] = True
    assert not k_cache.view(torch.uint8).view(num_blocks * block_size, -1)[~touched].any()  # padding: nothing

    qs = [torch.randn(n, heads, dim) for _, n in seqs]
    width = max(map(len, tables))
    out = paged_attention(
        torch.cat(qs), k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()], dtype=torch.int32),
        dim ** -0.5, 0, k_scale, v_scale)
    k_deq, v_deq = k_q.float() * k_scale, v_q.float() * v_scale  # what attention must read
    ref = torch.cat([_plain_attention(q, k, v, dim ** -0.5) for q, k, v in
                     zip(qs, k_deq.split(lengths), v_deq.split(lengths))])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # ... and not what a float cache would have given (the quantization is real).
    exact = torch.cat([_plain_attention(q, k, v, dim ** -0.5) for q, k, v in
                       zip(qs, k_all.split(lengths), v_all.split(lengths))])
    # FP8 keeps 3 mantissa bits (about 6% of a value), INT8 1/254 of the range: fp8 moves more.
    assert not torch.allclose(out, exact, atol=1e-5) and torch.allclose(out, exact, atol=0.5)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_values_past_the_scale_saturate_instead_of_overflowing(dtype):
    k = torch.tensor([[[-1e6, -2.0, 0.4, 3.0, 1e6, 0.5]]])  # [1, 1, 6]
    k_cache = torch.zeros(1, 1, 1, 6, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    one = torch.ones(1)
    write_kv_cache(k, k, k_cache, v_cache, torch.tensor([0]), one, one)
    if dtype == torch.float8_e4m3fn:  # 0.4 is no e4m3 number: the nearest one is 0.40625
        expected = [-448.0, -2.0, 0.40625, 3.0, 448.0, 0.5]
    else:  # rounded to nearest, ties to even
        expected = [-128.0, -2.0, 0.0, 3.0, 127.0, 0.0]
    assert k_cache.float().flatten().tolist() == expected


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_fused_rotary_write_stores_the_quantized_rotated_keys(dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim, block_size = 6, 4, 2, 8, 4
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2) * 3
    cos, sin = angles.cos(), angles.sin()
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.03])
    k_cache = torch.zeros(3, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 6, 7, 8, -1, 0])
    q_out = rotary_embedding_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, k_scale, v_scale)
    q_rot, k_rot = rotary_embedding(q, k, cos, sin)
    assert torch.equal(q_out, q_rot)
    keep = slots >= 0
    stored_k = k_cache.view(torch.uint8).view(-1, kv_heads, dim)[slots[keep]]
    stored_v = v_cache.view(torch.uint8).view(-1, kv_heads, dim)[slots[keep]]
    assert torch.equal(stored_k, _quantize(k_rot[keep], 0.02, dtype).view(torch.uint8))
    assert torch.equal(stored_v, _quantize(v[keep], 0.03, dtype).view(torch.uint8))


def _call_each_op(k_cache, k_scale, v_scale):
    """Calls the three ops on `k_cache` with the given scales (v_cache alike)."""
    kv_heads, dim = k_cache.shape[2:]
    q, k = torch.randn(2, 2 * kv_heads, dim), torch.randn(2, kv_heads, dim)
    cos, sin = torch.ones(2, dim // 2), torch.zeros(2, dim // 2)
    v_cache, slots = torch.zeros_like(k_cache), torch.tensor([0, 1])
    tables = torch.zeros(1, 1, dtype=torch.int32)  # one sequence of 2 tokens in block 0
    lens, starts = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    return [
        lambda: write_kv_cache(k, k, k_cache, v_cache, slots, k_scale, v_scale),
        lambda: rotary_embedding_and_write_kv(q, k, k, cos, sin, k_cache, v_cache, slots, k_scale, v_scale),
        lambda: paged_attention(q, k_cache, v_cache, tables, lens, starts, 0.5, 0, k_scale, v_scale),
    ]


@pytest.mark.parametrize("cache_dtype, k_scale, v_scale, message", [
    (torch.float8_e4m3fn, None, None, "k_scale is required for a torch.float8_e4m3fn KV cache"),
    (torch.int8, torch.ones(1), None, "v_scale is required for a torch.int8 KV cache"),
    (torch.float32, torch.ones(1), torch.ones(1), "k_scale is given but the KV cache is torch.float32"),
    (torch.bfloat16, None, torch.ones(1), "v_scale is given but the KV cache is torch.bfloat16"),
    (torch.float8_e4m3fn, torch.ones(2), torch.ones(1), r"k_scale must have shape \(1,\), got \(2,\)"),
    (torch.int8, torch.ones(1), torch.tensor(1.0), r"v_scale must have shape \(1,\), got \(\)"),
    (torch.int8, torch.ones(1, dtype=torch.float64), torch.ones(1), "k_scale has dtype torch.float64"),
    (torch.uint8, None, None, "k_cache has dtype torch.uint8"),
], ids=["fp8-none", "int8-one", "float32-both", "bf16-v", "shape-2", "shape-scalar", "float64",
        "uint8-cache"])
def test_bad_scales_are_refused_by_every_op(cache_dtype, k_scale, v_scale, message):
    k_cache = torch.zeros(1, 4, 2, 8, dtype=cache_dtype)
    for call in _call_each_op(k_cache, k_scale, v_scale):
        with pytest.raises(ValueError, match=message):
            call()
    assert not k_cache.view(torch.uint8).any()  # nothing was written


def test_scales_through_the_custom_ops_match_the_reference():
    """Calls through torch.library (what non-CPU and traced tensors take): Optional[Tensor] args, fakes."""
    torch.manual_seed(2)
    k_cache = torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k, v, scale = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0.01])
    slots = torch.tensor([0, 1, 2])
    torch.ops.kiln.write_kv_cache(k, v, k_cache, v_cache, slots, scale, scale)
    expected = torch.zeros_like(k_cache)
    write_kv_cache(k, v, expected, torch.zeros_like(k_cache), slots, scale, scale)
    assert torch.equal(k_cache.view(torch.uint8), expected.view(torch.uint8))
    q = torch.randn(3, 4, 8)
    args = (q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 0.35, 0)
    through_op = torch.ops.kiln.paged_attention(*args, scale, scale)
    assert torch.equal(through_op, paged_attention(*args, scale, scale))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k_cache, v_cache, scale)]
        metadata = [mode.from_tensor(t) for t in args[3:6]]
        out = torch.ops.kiln.paged_attention(*fake[:3], *metadata, 0.35, 0, fake[3], fake[3])
        assert out.shape == q.shape


# --- engine_format: build_config.kv_cache_dtype and kv_cache_scales ---

def _build(**changes) -> EngineBuildConfig:
    base = dict(dtype="bfloat16", max_batch_size=8, max_num_tokens=256, max_seq_len=1024, kv_block_size=16,
                kv_cache_dtype="bfloat16")
    return EngineBuildConfig(**{**base, **changes})


@pytest.mark.parametrize("name, dtype", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_build_config_round_trips_a_quantized_cache_through_json(name, dtype):
    build = _build(kv_cache_dtype=name, kv_cache_scales=[[0.5, 1], (2.0, 0.25)])
    assert build.kv_cache_scales == ((0.5, 1.0), (2.0, 0.25)) and build.kv_cache_quantized
    assert build.kv_cache_torch_dtype == dtype == KV_CACHE_DTYPES[name]
    doc = json.loads(json.dumps(build.to_dict()))
    assert doc["kv_cache_scales"] == [[0.5, 1.0], [2.0, 0.25]]
    assert EngineBuildConfig.from_dict(doc) == build
    plain = _build()
    assert plain.to_dict()["kv_cache_scales"] is None
    assert EngineBuildConfig.from_dict(plain.to_dict()) == plain
    assert not plain.kv_cache_quantized and plain.kv_cache_torch_dtype == torch.bfloat16


@pytest.mark.parametrize("changes, message", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_scales=None: a kv_cache_dtype='fp8' cache needs"),
    (dict(kv_cache_dtype="int8"), "kv_cache_scales=None: a kv_cache_dtype='int8' cache needs"),
    (dict(kv_cache_scales=[[1.0, 1.0]]),
     "kv_cache_scales=[[1.0, 1.0]] must be null for kv_cache_dtype='bfloat16'"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales=[]), "kv_cache_scales=[] must be a non-empty list"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales="0.5"), "kv_cache_scales='0.5' must be a non-empty list"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales=[[1.0, 1.0], [1.0, 0.0]]),
     "kv_cache_scales[1]=[1.0, 0.0] must be"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[[-1.0, 1.0]]), "kv_cache_scales[0]=[-1.0, 1.0] must be"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[[math.nan, 1.0]]), "kv_cache_scales[0]=[nan, 1.0] must be"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[[math.inf, 1.0]]), "kv_cache_scales[0]=[inf, 1.0] must be"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[[True, 1.0]]), "kv_cache_scales[0]=[True, 1.0] must be"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[["1", 1.0]]), "kv_cache_scales[0]=['1', 1.0] must be"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[[1.0]]),
     "kv_cache_scales[0]=[1.0] must be a [k_scale, v_scale]"),
    (dict(kv_cache_dtype="int8", kv_cache_scales=[1.0, 1.0]), "kv_cache_scales[0]=1.0 must be"),
    (dict(kv_cache_dtype="float8"),
     "kv_cache_dtype='float8' must be one of float32, float16, bfloat16, fp8, int8"),
    (dict(dtype="fp8"), "dtype='fp8' must be one of float32, float16, bfloat16"),
])
def test_build_config_refuses_bad_kv_cache_settings_naming_field_and_value(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _build(**changes)


# --- runtime: KVCache, the FP8 device check ---

CONFIG = ModelConfig("LlamaForCausalLM", 32, 8, 16, 3, 2, 1, 4, 1e-6, 64, RopeConfig())  # 3 layers, 1 kv head


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_kv_cache_holds_one_byte_elements_and_per_layer_scale_tensors(dtype):
    scales = [(0.5, 0.25), (1.0, 2.0), (0.125, 4.0)]
    cache = KVCache(CONFIG, 5, 4, dtype, torch.device("cpu"), scales)
    assert cache.storage.dtype == dtype and cache.layers[2][1].dtype == dtype
    assert KVCache.bytes_per_token(CONFIG, dtype) == 2 * 3 * 1 * 4
    assert KVCache.bytes_per_block(CONFIG, 4, torch.float32) == 4 * KVCache.bytes_per_block(CONFIG, 4, dtype)
    assert cache.nbytes == 5 * KVCache.bytes_per_block(CONFIG, 4, dtype)
    assert [(k.item(), v.item()) for k, v in cache.scales] == scales
    assert all(t.shape == (1,) and t.dtype == torch.float32 for pair in cache.scales for t in pair)
    with pytest.raises(ValueError, match="needs scales"):
        KVCache(CONFIG, 5, 4, dtype, torch.device("cpu"))
    with pytest.raises(ValueError, match="2 KV-cache scale pairs for a model of 3 layers"):
        KVCache(CONFIG, 5, 4, dtype, torch.device("cpu"), scales[:2])
    with pytest.raises(ValueError, match="layer 1"):
        KVCache(CONFIG, 5, 4, dtype, torch.device("cpu"), [scales[0], (0.0, 1.0), scales[2]])
    with pytest.raises(ValueError, match="scales are only for"):
        KVCache(CONFIG, 5, 4, torch.float16, torch.device("cpu"), scales)


@pytest.mark.parametrize("capability, kv, qformat, refused", [
    ((8, 0), "fp8", None, "--kv-cache-dtype int8 or auto"),  # A100
    ((8, 6), "int8", "fp8", "--qformat int8_sq or int4_awq"),
    ((7, 5), "fp8", "fp8", "--kv-cache-dtype int8 or auto and --qformat int8_sq or int4_awq"),
    ((8, 0), "int8", "int8_sq", None),
    ((8, 9), "fp8", "fp8", None),  # Ada
    ((9, 0), "fp8", None, None),  # Hopper
])
def test_fp8_engines_are_refused_on_gpus_before_ada(monkeypatch, capability, kv, qformat, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    build = _build(kv_cache_dtype=kv, kv_cache_scales=[[1.0, 1.0]],
                   quantization=None if qformat is None else {"qformat": qformat})
    check_device_supports(build, torch.device("cpu"))  # the CPU runs every format
    if refused is None:
        check_device_supports(build, torch.device("cuda"))
        return
    with pytest.raises(EngineError, match="compute capability 8.9 or newer") as info:
        check_device_supports(build, torch.device("cuda"))
    assert refused in str(info.value) and f"{capability[0]}.{capability[1]}" in str(info.value)


# --- whole engines: a float engine, and its FP8 / INT8 twins ---

PROMPTS_SEED = 7


def _prompts(n, seed, low=1, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(2, 400) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.fixture(scope="module")
def float_engine(tmp_path_factory):
    _, engine, _ = make_engine(tmp_path_factory.mktemp("kvq"), max_batch_size=8, max_num_tokens=128,
                               max_seq_len=128, kv_block_size=4)
    return engine


@pytest.fixture(scope="module")
def calibrated_amax(float_engine):
    """Per layer (k amax, v amax) over what a float run left in its cache: the rotated keys and the values."""
    llm = LLM(float_engine, enable_prefix_caching=False)
    llm.generate(_prompts(8, seed=PROMPTS_SEED), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    storage = llm.engine.executor.runner.kv_cache.storage  # [L, 2, N, bs, Hk, D]; unused slots stay 0
    return storage.abs().amax(dim=(2, 3, 4, 5)).tolist()  # [L][2]


def _twin(float_engine, dst, change):
    shutil.copytree(float_engine, dst)
    doc = json.loads((dst / "engine.json").read_text())
    change(doc["build_config"])
    (dst / "engine.json").write_text(json.dumps(doc))  # engine.json is not in its own manifest
    return dst


@pytest.fixture(scope="module", params=["fp8", "int8"])
def quant_engine(request, float_engine, calibrated_amax, tmp_path_factory):
    name = request.param
    qmax = 448.0 if name == "fp8" else 127.0
    scales = [[k / qmax, v / qmax] for k, v in calibrated_amax]
    dst = tmp_path_factory.mktemp(f"kvq-{name}") / "engine"
    return name, _twin(float_engine, dst, lambda b: b.update(kv_cache_dtype=name, kv_cache_scales=scales))


def _teacher_forced(engine_dir, prompts, **options):
    """Per prompt, per position after the first: (logprob of the prompt's token, the model's top-1 token)."""
    llm = LLM(engine_dir, enable_prefix_caching=False, **options)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True, prompt_top_logprobs=1)
    outs = llm.generate(prompts, params)
    return [[(lp, next(iter(top))) for lp, top in zip(o.prompt_logprobs[1:], o.prompt_top_logprobs[1:])]
            for o in outs]


def test_quantized_cache_stays_close_to_the_float_engine(float_engine, quant_engine):
    name, engine = quant_engine
    prompts = _prompts(6, seed=11, low=30, high=60)
    ref, got = _teacher_forced(float_engine, prompts), _teacher_forced(engine, prompts)
    pairs = [(r, g) for rs, gs in zip(ref, got) for r, g in zip(rs, gs)]
    max_diff = max(abs(r[0] - g[0]) for r, g in pairs)
    agree = sum(r[1] == g[1] for r, g in pairs) / len(pairs)
    # The cache is really quantized (logprobs move), but only a little: a tiny random model whose logits have
    # clear winners keeps nearly every top-1 token.
    assert 0 < max_diff < (0.5 if name == "fp8" else 0.25), max_diff
    assert agree >= 0.9, agree


def test_quantized_engine_runs_batched_chunked_and_prefix_cached_like_alone(quant_engine):
    name, engine = quant_engine
    rng = random.Random(3)
    shared = [rng.randrange(2, 400) for _ in range(21)]
    prompts = _prompts(10, seed=5) + [shared + [11, 12], shared + [21, 22, 23], shared]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True) for _ in prompts]
    alone_llm = LLM(engine, enable_prefix_caching=False)
    runner = alone_llm.engine.executor.runner
    assert runner.kv_cache.dtype == KV_CACHE_DTYPES[name] and len(runner.kv_cache.scales) == 2
    report = alone_llm.engine.memory_report
    # (k, v) x 2 layers x 2 kv heads x 16 dims x 1 byte
    assert report.kv_bytes_per_token == 2 * 2 * 2 * 16 * 1
    assert report.kv_cache_dtype == str(KV_CACHE_DTYPES[name]).removeprefix("torch.")
    assert f"{report.kv_bytes_per_token} bytes per token" in report.summary()
    alone = [alone_llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]

    # 4 requests and 16 tokens a step: prompts are chunked, requests queue and share the prefix cache.
    llm = LLM(engine, max_batch_size=4, max_num_tokens=16)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == alone
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert sum(o.num_cached_tokens for o in outputs) > 0
    again = llm.generate(prompts[-3:], params[-3:])  # prefix blocks written by earlier requests
    assert [o.token_ids for o in again] == alone[-3:] and all(o.num_cached_tokens >= 20 for o in again)
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_engine_json_with_bad_kv_cache_scales_is_refused(float_engine, tmp_path):
    no_scales = _twin(float_engine, tmp_path / "a", lambda b: b.update(kv_cache_dtype="fp8"))
    with pytest.raises(EngineError, match="build_config: kv_cache_scales=None: a kv_cache_dtype='fp8' cache"):
        LLM(no_scales)
    short = _twin(float_engine, tmp_path / "b",
                  lambda b: b.update(kv_cache_dtype="int8", kv_cache_scales=[[1, 1]]))
    with pytest.raises(EngineError, match="kv_cache_scales has 1 .* the model has 2 layers") as info:
        LLM(short)
    assert "engine.json" in str(info.value)


def test_create_executor_refuses_fp8_on_an_old_gpu_before_loading_weights(float_engine, tmp_path,
                                                                         monkeypatch):
    engine = _twin(float_engine, tmp_path / "fp8",
                   lambda b: b.update(kv_cache_dtype="fp8", kv_cache_scales=[[0.01, 0.01]] * 2))
    info = load_engine_info(engine)
    runtime = dataclasses.replace(resolve_runtime(info), device=torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the device check")

    monkeypatch.setattr("kiln.runtime.engine.factory.load_network", no_loading)
    with pytest.raises(EngineError, match="rebuild the engine with --kv-cache-dtype int8 or auto"):
        create_executor(info, runtime)


# --- CUDA: quantized caches through the Triton kernels, decode steps in CUDA graphs ---

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_cuda_quantized_ops_give_the_cpu_results(dtype):
    torch.manual_seed(3)
    heads, kv_heads, dim, block_size, num_blocks = 8, 2, 64, 16, 12
    seqs = [(30, 1), (0, 20), (17, 1), (5, 9)]
    lengths = [c + n for c, n in seqs]
    tables, slots = _layout(lengths, block_size, num_blocks)
    k, v = torch.randn(sum(lengths), kv_heads, dim), torch.randn(sum(lengths), kv_heads, dim)
    k_scale, v_scale = _scale(k, dtype), _scale(v, dtype)
    q = torch.randn(sum(n for _, n in seqs), heads, dim)
    width = max(map(len, tables))
    meta = (torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(lengths, dtype=torch.int32),
            torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()], dtype=torch.int32))
    outs, caches = [], []
    for device in ("cpu", "cuda"):
        k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        ks, vs = k_scale.to(device), v_scale.to(device)
        write_kv_cache(k.to(device), v.to(device), k_cache, v_cache,
                       torch.tensor([s for ss in slots for s in ss], device=device), ks, vs)
        out = paged_attention(q.to(device), k_cache, v_cache, *(t.to(device) for t in meta), dim ** -0.5, 0,
                              ks, vs)
        outs.append(out.cpu())
        caches.append(k_cache.view(torch.uint8).cpu())
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_cuda_quantized_engine_runs_in_graphs_and_batches_like_alone(tmp_path, name):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    limits = dict(dtype="bfloat16", max_batch_size=8, max_num_tokens=64, max_seq_len=128, kv_block_size=4)
    float_engine = build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", **limits),
                                progress=False)
    calib = LLM(float_engine, num_kv_blocks=256, cuda_graphs=False)
    calib.generate(_prompts(8, seed=PROMPTS_SEED),
                   SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    amax = calib.engine.executor.runner.kv_cache.storage.float().abs().amax(dim=(2, 3, 4, 5)).tolist()
    qmax = 448.0 if name == "fp8" else 127.0
    engine = _twin(float_engine, tmp_path / name, lambda b: b.update(
        kv_cache_dtype=name, kv_cache_scales=[[k / qmax, v / qmax] for k, v in amax]))
    llm = LLM(engine, num_kv_blocks=256)
    runner = llm.engine.executor.runner
    assert runner.graphs is not None and runner.kv_cache.dtype == KV_CACHE_DTYPES[name]
    assert runner.kv_cache.scales[0][0].device.type == "cuda"
    prompts = _prompts(10, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert [llm.generate(p, params)[0].token_ids for p in prompts[::3]] == batched[::3]
    # A fixed cache size: by default a GPU fills its memory with blocks the block manager lists one by one.
    ref = _teacher_forced(float_engine, prompts, num_kv_blocks=256)
    got = _teacher_forced(engine, prompts, num_kv_blocks=256)
    pairs = [(r, g) for rs, gs in zip(ref, got) for r, g in zip(rs, gs)]
    assert sum(r[1] == g[1] for r, g in pairs) / len(pairs) >= 0.85

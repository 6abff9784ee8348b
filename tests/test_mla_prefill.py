"""MLA's explicit prefill (model_defs/layers/mla_prefill.py, mla_split.py): the sequences of an eager step with
at least EXPLICIT_MIN_QUERY queries are computed with keys and values up-projected from the latent cache, the
rest absorbed. Both forms give the same layer output on a mixed step (a decode row, a chunk after earlier
chunks, a fresh prompt, a short chunk; rows not grouped by form), the split is made once per step and graph
contexts (no host lengths) stay absorbed, and an engine that takes the explicit path keeps transformers' greedy
tokens under chunked prefill and prefix caching."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from model_factory import BASE, hf_greedy
from test_models_deepseek import CASES, LIMITS, make_checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.model_defs import build_network, get_model_def
from kiln.model_defs.layers import mla as mla_module
from kiln.model_defs.layers import mla_split
from kiln.model_defs.layers.mla_split import EXPLICIT_MIN_QUERY
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.worker.kv_cache import KVCache
from kiln.runtime.worker.step_inputs import build_context

BLOCK_SIZE = 4
# (cached keys, this step's queries) per sequence, in row order: a chunk after 20 earlier tokens (explicit), a
# decode row, a fresh prompt (explicit), a short chunk after 9 (absorbed)
SEQUENCES = ((20, 36), (40, 1), (0, 40), (9, 5))


def _network(dtype: torch.dtype, device: str):
    """A V3-shaped network with random weights (q low rank, three MLA layers) in `dtype` on `device`."""
    architecture, overrides = CASES["v3"]
    raw = {**BASE, **overrides, "architectures": [architecture]}
    model_def = get_model_def(architecture)
    config = model_def.parse_config(raw)
    torch.manual_seed(1)
    with torch.device(device):
        net = build_network(model_def, config, dtype=dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    net.setup_rotary(128, device)
    return config, net


def _tables() -> list[list[int]]:
    """Each sequence's blocks, taken from the end of the pool backwards so that no table is consecutive."""
    tables, free = [], list(range(63, -1, -1))
    for cached, new in SEQUENCES:
        need = -(-(cached + new) // BLOCK_SIZE)
        tables.append(free[:need])
        free = free[need:]
    return tables


def _step(config, cache: KVCache, tables, sequences, device: str):
    """build_context's context (host lengths set) for `sequences` [(cached, new)]: the new tokens' rows."""
    positions, slots, lens = [], [], []
    for table, (cached, new) in zip(tables, sequences):
        positions.extend(range(cached, cached + new))
        slots.extend(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new))
        lens.append(new)
    return build_context(positions=positions, rope_lengths=[p + 1 for p in positions], slots=slots, tables=tables,
                         query_lens=lens, kv_caches=cache.layers, device=torch.device(device))


def _filled_cache(config, net, dtype: torch.dtype, device: str):
    """A cache whose sequences hold their cached prefixes, written by the network's own steps."""
    cache = KVCache(config, 64, BLOCK_SIZE, dtype, torch.device(device))
    tables = _tables()
    prefix = [(0, cached) for cached, _ in SEQUENCES if cached]
    ctx = _step(config, cache, [t for t, (c, _) in zip(tables, SEQUENCES) if c], prefix, device)
    with torch.no_grad():
        net(torch.randint(2, 300, (sum(n for _, n in prefix),), device=device), ctx)
    return cache, tables


def _both_forms(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer 0's output on the mixed step with the split and without (host lengths removed), and the
    per-sequence explicit reference (`MLAttention.explicit_attention`, float32)."""
    config, net = _network(dtype, device)
    cache, tables = _filled_cache(config, net, dtype, device)
    ctx = _step(config, cache, tables, SEQUENCES, device)
    absorbed_ctx = dataclasses.replace(ctx, host_query_lens=None, host_seq_lens=None)
    assert absorbed_ctx.mla_split is None
    split = ctx.mla_split
    assert [s.rows for s in split.explicit] == [slice(0, 36), slice(37, 77)]
    assert split.absorbed.rows.tolist() == [36, 77, 78, 79, 80, 81]
    attn = net.model.layers[0].self_attn
    torch.manual_seed(2)
    x = torch.randn(ctx.positions.shape[0], config.hidden_size, device=device, dtype=dtype)
    cos, sin = net.rotary.lookup(ctx.positions, ctx.rope_lengths, ctx.max_rope_length)
    # on CUDA the explicit attention must take the flash kernel (is_causal or lower-right causal, v padded)
    flash_only = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device == "cuda" else contextlib.nullcontext()
    with torch.no_grad():
        with flash_only:
            explicit = attn(x, ctx, cos, sin)
        absorbed = attn(x, absorbed_ctx, cos, sin)
        q_nope, q_pe, _ = attn.project(x, cos, sin)
        starts = ctx.query_start_loc.tolist()
        reference = torch.cat([
            attn.explicit_attention(q_nope[a:b], q_pe[a:b], cache.layers[0][0], ctx.block_tables[s], c + n)
            for s, (a, b, (c, n)) in enumerate(zip(starts, starts[1:], SEQUENCES))])
        reference = attn.o_proj(reference.to(dtype).reshape(x.shape[0], -1))
    return explicit, absorbed, reference


def test_explicit_prefill_equals_the_absorbed_form_float32():
    explicit, absorbed, reference = _both_forms(torch.float32, "cpu")
    torch.testing.assert_close(explicit, absorbed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(explicit, reference, rtol=1e-4, atol=1e-4)


def test_explicit_prefill_equals_the_absorbed_form_bfloat16_cpu():
    explicit, absorbed, reference = _both_forms(torch.bfloat16, "cpu")
    scale = reference.float().abs().max().item()
    assert (explicit.float() - absorbed.float()).abs().max().item() < 0.03 * scale
    assert (explicit.float() - reference.float()).abs().max().item() < 0.03 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_explicit_prefill_equals_the_absorbed_form_bfloat16_cuda():
    """Flash attention (lower-right causal for the chunk) against the Triton absorbed kernel, in bf16."""
    explicit, absorbed, reference = _both_forms(torch.bfloat16, "cuda")
    scale = reference.float().abs().max().item()
    assert (explicit.float() - absorbed.float()).abs().max().item() < 0.03 * scale
    assert (explicit.float() - reference.float()).abs().max().item() < 0.03 * scale


def test_the_split_is_made_once_per_step_and_graph_contexts_stay_absorbed(monkeypatch):
    config, net = _network(torch.float32, "cpu")
    cache, tables = _filled_cache(config, net, torch.float32, "cpu")
    made, explicit_calls = [], []
    init = mla_split.MLASplit.__init__
    monkeypatch.setattr(mla_split.MLASplit, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    prefill = mla_module.explicit_prefill
    monkeypatch.setattr(mla_module, "explicit_prefill", lambda *a: explicit_calls.append(1) or prefill(*a))
    ctx = _step(config, cache, tables, SEQUENCES, "cpu")
    ids = torch.randint(2, 300, (ctx.positions.shape[0],))
    with torch.no_grad():
        net(ids, ctx)
        assert len(made) == 1 and len(explicit_calls) == config.num_layers  # one split, read by every layer
        # what a CUDA-graph context carries: no host lengths
        net(ids, dataclasses.replace(ctx, host_query_lens=None, host_seq_lens=None))
        # a step of short sequences only: nothing explicit, no split
        short = _step(config, cache, tables, [(c + n - 1, 1) for c, n in SEQUENCES], "cpu")
        assert short.mla_split is None
        net(ids[:len(SEQUENCES)], short)
    assert len(made) == 1 and len(explicit_calls) == config.num_layers


def test_engine_with_explicit_prefill_matches_transformers(tmp_path, monkeypatch):
    """A 100-token prompt in chunks of 64 and 36 (the second over the first's keys); then short prompts, a fresh
    60-token one and one whose first 64 tokens are prefix-cached, the latter's 40 computed in a step beside
    decode rows and the former's short last chunk: greedy tokens equal transformers'."""
    mixed = []  # per explicit_prefill call: whether the step had absorbed rows too
    prefill = mla_module.explicit_prefill
    monkeypatch.setattr(mla_module, "explicit_prefill",
                        lambda *a: mixed.append(a[6].absorbed is not None) or prefill(*a))
    architecture, overrides = CASES["v2-lite"]
    checkpoint, model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**LIMITS), progress=False)
    long = [(13 * i + 5) % 390 + 2 for i in range(100)]
    prompts = [[(3 * i + n) % 390 + 2 for i in range(n)] for n in (3, 9, 60)]
    prompts.append(long[:64] + [(7 * i + 1) % 390 + 2 for i in range(40)])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert 36 >= EXPLICIT_MIN_QUERY
    with LLM(engine, max_num_tokens=64, max_batch_size=4) as llm:
        outputs = llm.generate([long], params)
        assert mixed == [False] * 6  # two chunks, three layers
        outputs += llm.generate(prompts, params)
        stats = llm.kv_cache_stats()
    assert len(mixed) == 12 and all(mixed[6:])  # the fresh prompt's first chunk, the prefix-cached one's 40
    assert stats["prefix_cache_hit_tokens"] >= 64
    for prompt, out in zip([long] + prompts, outputs):
        assert out.token_ids == hf_greedy(model, prompt, 6), f"prompt of {len(prompt)} tokens"

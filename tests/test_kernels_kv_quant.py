"""The Triton KV-write and paged-attention kernels on quantized (float8_e4m3fn, int8) KV caches, against the
PyTorch references: on the CPU through Triton's interpreter (tiny shapes, float16), and on CUDA (Llama-8B
heads, bfloat16 / float16).

The writes quantize in the reference's order (IEEE x / scale, saturate, one rounding half to even), so the
cache bytes must be equal. Attention reads the same bytes but folds the scales out of its dots and rounds p
to the activation dtype as the float path does, so it is compared within the float-cache tests' tolerance.
"""

from __future__ import annotations

import pytest
import torch
from cuda_graph_capture import capture
from triton_interpret import needs_triton, run_interpreted

from kiln.model_defs.config import RopeConfig
from kiln.model_defs.layers.rotary import RotaryTables
from kiln.plugins import paged_attention, rotary_embedding_and_write_kv
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.attention import paged_attention_reference
from kiln.plugins.kv_cache import quantize_kv, write_kv_cache_reference
from kiln.plugins.rotary_kv import rotary_embedding_and_write_kv_reference

QUANT = [torch.float8_e4m3fn, torch.int8]
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}

# --- CPU: the kernels under Triton's interpreter ---

_INTERPRETED_CHECKS = """
import torch
from kiln.plugins.attention import paged_attention_reference
from kiln.plugins.kv_cache import quantize_kv, write_kv_cache_reference
from kiln.plugins.rotary_kv import rotary_embedding_and_write_kv_reference
from kiln.plugins.triton_attention import _launch_config, paged_attention_triton
from kiln.plugins.triton_rotary_kv import rotary_embedding_and_write_kv_triton, write_kv_cache_triton

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
gen = torch.Generator().manual_seed(0)


def random_bytes(shape, dtype):
    # Random old contents: a write to a wrong or skipped slot shows.
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)


def assert_same_bytes(got, want, what):
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.numel()} bytes differ"


def check_writes(cache_dtype):
    tokens, heads, kv_heads, dim, block_size, num_blocks = 9, 4, 2, 64, 16, 3
    q = torch.randn(tokens, heads, dim, generator=gen).half()
    k = (torch.randn(tokens, kv_heads, dim, generator=gen) * 3).half()
    v = torch.randn(tokens, kv_heads, dim, generator=gen).half()
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # saturate; keep the sign of zero
    k[0, 0, 4:6] = torch.tensor([-1e-6, 1e-6])  # round to -0.0 and +0.0 (a GPU build once lost that sign)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.013])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1  # a padding token writes nothing
    angles = torch.rand(tokens, dim // 2, generator=gen) * 3
    for fused in (False, True):
        caches = [random_bytes((num_blocks, block_size, kv_heads, dim), cache_dtype) for _ in range(2)]
        ref = [c.clone() for c in caches]
        if fused:
            q_out = rotary_embedding_and_write_kv_triton(q, k, v, angles.cos(), angles.sin(), *caches, slots,
                                                         k_scale, v_scale)
            q_ref = rotary_embedding_and_write_kv_reference(q, k, v, angles.cos(), angles.sin(), *ref, slots,
                                                            k_scale, v_scale)
            assert torch.equal(q_out, q_ref)
        else:
            write_kv_cache_triton(k, v, *caches, slots, k_scale, v_scale)
            write_kv_cache_reference(k, v, *ref, slots, k_scale, v_scale)
        assert_same_bytes(caches[0], ref[0], f"{cache_dtype} k, fused={fused}")
        assert_same_bytes(caches[1], ref[1], f"{cache_dtype} v, fused={fused}")


def check_rounding(cache_dtype):
    # Every float8 value, the midpoints between neighbours (ties, half to even) and their float32 neighbours,
    # values past the range; scaled by 1/4 for int8, which puts ties at n + 0.5.
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.tensor([449.0, 464.0, 470.0, 1e30, -464.0, -1e30])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 64)).view(-1, 1, 64)  # [T, 1 head, 64]
    if cache_dtype == torch.int8:
        x = x / 4
    one, slots = torch.ones(1), torch.arange(x.shape[0])
    cache = torch.zeros(x.shape[0], 1, 1, 64, dtype=cache_dtype)  # one token a block
    ref = torch.zeros_like(cache)
    write_kv_cache_triton(x, x, cache, torch.empty_like(cache), slots, one, one)
    write_kv_cache_reference(x, x, ref, torch.empty_like(ref), slots, one, one)
    assert_same_bytes(cache, ref, f"{cache_dtype} rounding")


def attention_batch(seqs, cache_dtype, heads=4, kv_heads=2, dim=32, block_size=16):
    # seqs: (cached, new) per sequence; (-1, 1) is a padding row (seq_len 0). Slots no sequence owns hold
    # float8 NaN (0x7f; 127 for int8), as do the table entries past a sequence's blocks.
    lengths = [cached + new for cached, new in seqs]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(map(len, tables)) + 1
    tables = [t + [free[0]] * (width - len(t)) for t in tables]
    caches = []
    for magnitude in (2.0, 1.0):
        x = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen) * magnitude
        scale = (x.abs().amax() / QMAX[cache_dtype]).reshape(1)
        stored = torch.full((num_blocks * block_size, kv_heads, dim), 0x7F, dtype=torch.uint8).view(cache_dtype)
        for table, n in zip(tables, lengths):
            pos = torch.arange(n)
            owned = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
            stored.view(torch.uint8)[owned] = quantize_kv(x[owned], scale, cache_dtype).view(torch.uint8)
        caches.append((stored.view(num_blocks, block_size, kv_heads, dim), scale))
    starts = torch.tensor([0] + [new for _, new in seqs]).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).half()
    i32 = dict(dtype=torch.int32)
    args = (q, caches[0][0], caches[1][0], torch.tensor(tables, **i32), torch.tensor(lengths, **i32), starts)
    return args, (caches[0][1], caches[1][1])


def check_attention(cache_dtype):
    decode = [(40, 1), (700, 1), (7, 1), (-1, 1)]
    # 700 keys in a table of 45 blocks: the decode path splits the keys (and merges the parts).
    assert _launch_config(4, 4, 2, 2, 32, 2, 45 * 16, 132, decode=True).num_splits > 1
    chunked = [(0, 20), (33, 1), (5, 12), (16, 17)]  # a prefill, a decode, chunks after cached prefixes
    for seqs in (decode, chunked):
        args, scales = attention_batch(seqs, cache_dtype)
        out = paged_attention_triton(*args, 32 ** -0.5, 0, *scales)
        ref = paged_attention_reference(*args, 32 ** -0.5, 0, *scales)
        assert torch.isfinite(out).all() and out.dtype == torch.float16
        # Same stored values on both sides; the kernel rounds p to float16 before p @ v (relative 2**-11, so
        # |out| moves by <= 2**-11 * max|v| ~ 2e-3 for |v| <= 4) and the output to float16 (another ulp):
        # the float16 tolerance of the float-cache attention tests.
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)
        if seqs is decode:
            assert out[-1].eq(0).all()  # the padding row


for cache_dtype in QMAX:
    check_writes(cache_dtype)
    check_rounding(cache_dtype)
    check_attention(cache_dtype)
print("ok")
"""


@needs_triton
def test_interpreted_kernels_match_the_references_on_quantized_caches():
    assert run_interpreted(_INTERPRETED_CHECKS).strip().endswith("ok")


# --- CUDA ---

needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                                        reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")
ACT_DTYPES = [torch.bfloat16, torch.float16]
# Attention on the same stored values as the reference: the float-cache tests' tolerances
# (tests/test_kernels_attention.py), as the kernels round p and the output to the activation dtype as there.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
LLAMA3_ROPE = RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.numel()} bytes differ"


def _scales(k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Calibrated on 70% of the amax, so the largest values saturate.
    return tuple((0.7 * t.abs().amax().float() / QMAX[cache_dtype]).reshape(1) for t in (k, v))


def _write_case(dtype, cache_dtype, block_size=16, tokens=37):
    """Strided q, k, v views of one fused qkv output, llama3 cos/sin, slots with -1 rows, random old bytes."""
    gen = torch.Generator().manual_seed(block_size + tokens)
    qkv = (torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen) * 2).to("cuda", dtype)
    q, k, v = qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in (q, k, v))
    tables = RotaryTables(LLAMA3_ROPE, HEAD_DIM, 131072, 8192, "cuda")
    positions = torch.randint(0, 8192, (tokens,), generator=gen).cuda()
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    caches = [torch.randint(0, 256, (num_blocks, block_size, KV_HEADS, HEAD_DIM), generator=gen,
                            dtype=torch.uint8).cuda().view(cache_dtype) for _ in range(2)]
    return q, k, v, tables.cos[positions], tables.sin[positions], slots.cuda(), caches


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("cache_dtype", QUANT, ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_quantized_writes_store_the_reference_bytes(dtype, cache_dtype, tokens):
    from kiln.plugins.triton_rotary_kv import rotary_embedding_and_write_kv_triton, write_kv_cache_triton

    q, k, v, cos, sin, slots, caches = _write_case(dtype, cache_dtype, tokens=tokens)
    if tokens == 1:
        slots[0] = 3  # the case's every fifth -1 would skip the only token
    scales = _scales(k, v, cache_dtype)
    ref = [c.clone() for c in caches]
    write_kv_cache_triton(k, v, *caches, slots, *scales)
    write_kv_cache_reference(k, v, *ref, slots, *scales)
    _assert_same_bytes(caches[0], ref[0], "k")
    _assert_same_bytes(caches[1], ref[1], "v")

    ref = [c.clone() for c in caches]
    out_q = rotary_embedding_and_write_kv_triton(q, k, v, cos, sin, *caches, slots, *scales)
    ref_q = rotary_embedding_and_write_kv_reference(q, k, v, cos, sin, *ref, slots, *scales)
    assert torch.equal(out_q, ref_q)
    _assert_same_bytes(caches[0], ref[0], "rotated k")
    _assert_same_bytes(caches[1], ref[1], "v")


def _attention_batch(seqs, dtype, cache_dtype, block_size, *, padding_rows=0, seed=0):
    """Packed inputs on CUDA (as tests/test_kernels_attention.py's, quantized), plus `padding_rows` sequences
    of seq_len 0. Unowned slots and table entries past a sequence's blocks hold byte 0x7f (float8 NaN)."""
    torch.manual_seed(seed)
    seqs = list(seqs) + [(-1, 1)] * padding_rows
    lengths = [cached + new for cached, new in seqs]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(map(len, tables)) + 2
    caches, scales = [], []
    for magnitude in (2.0, 1.0):  # k, v
        x = torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, device="cuda") * magnitude
        scale = (x.abs().amax() / QMAX[cache_dtype]).reshape(1)
        cache = torch.full((num_blocks * block_size, KV_HEADS, HEAD_DIM), 0x7F, dtype=torch.uint8, device="cuda")
        for table, n in zip(tables, lengths):
            pos = torch.arange(n)
            owned = (torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size
                     + pos % block_size).cuda()
            cache[owned] = quantize_kv(x[owned], scale, cache_dtype).view(torch.uint8)
        caches.append(cache.view(cache_dtype).view(num_blocks, block_size, KV_HEADS, HEAD_DIM))
        scales.append(scale)
    tables = [t + [free[0] if free else 0] * (width - len(t)) for t in tables]
    starts = torch.tensor([0] + [new for _, new in seqs]).cumsum(0)
    q = torch.randn(int(starts[-1]), HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    as_int = dict(dtype=torch.int32, device="cuda")
    args = (q, *caches, torch.tensor(tables, **as_int), torch.tensor(lengths, **as_int), starts.to(**as_int))
    return args, tuple(scales)


def _check_attention(args, scales, sliding_window=0, padding_rows=0):
    from kiln.plugins.triton_attention import paged_attention_triton

    q = args[0]
    out = paged_attention_triton(*args, HEAD_DIM ** -0.5, sliding_window, *scales)
    ref = paged_attention_reference(*args, HEAD_DIM ** -0.5, sliding_window, *scales)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    if padding_rows:
        assert out[-padding_rows:].eq(0).all()
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# (tokens already cached, new tokens): fresh prefills, chunks after a cached prefix, decodes.
MIXED = [(0, 37), (50, 20), (300, 1), (0, 1), (1500, 300), (17, 1), (129, 130), (64, 64)]


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype, cache_dtype, block_size, sliding_window", [
    (torch.bfloat16, torch.float8_e4m3fn, 16, 0),
    (torch.float16, torch.int8, 16, 0),
    (torch.float16, torch.float8_e4m3fn, 32, 0),
    (torch.bfloat16, torch.int8, 32, 96),
], ids=["bf16-fp8-16", "fp16-int8-16", "fp16-fp8-32", "bf16-int8-32-window"])
def test_quantized_prefill_and_chunks_match_reference(dtype, cache_dtype, block_size, sliding_window):
    args, scales = _attention_batch(MIXED, dtype, cache_dtype, block_size, padding_rows=1)
    _check_attention(args, scales, sliding_window, padding_rows=1)


def _decode_seqs(batch, max_len, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lengths[0] = max_len
    return [(length - 1, 1) for length in lengths]


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype, cache_dtype, block_size, batch, max_len, sliding_window", [
    (torch.bfloat16, torch.float8_e4m3fn, 16, 1, 4096, 0),  # split-K
    (torch.float16, torch.int8, 16, 1, 4096, 0),
    (torch.bfloat16, torch.int8, 32, 1, 100, 0),
    (torch.float16, torch.float8_e4m3fn, 16, 64, 4096, 0),  # one split each
    (torch.bfloat16, torch.int8, 16, 64, 2000, 0),
    (torch.bfloat16, torch.float8_e4m3fn, 32, 4, 4096, 1000),
], ids=["bf16-fp8-b1-4096", "fp16-int8-b1-4096", "bf16-int8-b1-100", "fp16-fp8-b64-4096", "bf16-int8-b64-2000",
        "bf16-fp8-b4-window"])
def test_quantized_decode_matches_reference(dtype, cache_dtype, block_size, batch, max_len, sliding_window):
    args, scales = _attention_batch(_decode_seqs(batch, max_len, seed=batch), dtype, cache_dtype, block_size,
                                    padding_rows=2)
    _check_attention(args, scales, sliding_window, padding_rows=2)


@needs_triton
def test_decode_cases_split_as_intended():
    from kiln.plugins.triton_attention import _launch_config

    # A 1-byte cache is sized by its 2-byte dots: batch 1 at 4096 keys splits them, batch 64 does not.
    assert _launch_config(1, 1, KV_HEADS, 4, HEAD_DIM, 2, 4096 + 32, 132, decode=True).num_splits > 1
    assert _launch_config(64, 64, KV_HEADS, 4, HEAD_DIM, 2, 4096 + 32, 132, decode=True).num_splits == 1


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("cache_dtype", QUANT, ids=["fp8", "int8"])
def test_quantized_ops_run_the_kernels_inside_a_cuda_graph(cache_dtype):
    """The ops with scales dispatch to the kernels, which read the scales on the GPU: a decode layer's write
    and attention capture in a CUDA graph (the reference syncs with the host, which capture refuses) and its
    replay gives the launchers' results."""
    from kiln.plugins.triton_attention import paged_attention_triton
    from kiln.plugins.triton_rotary_kv import rotary_embedding_and_write_kv_triton

    for op in ("write_kv_cache", "rotary_embedding_and_write_kv", "paged_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CUDA"), op
    dtype, block_size = torch.bfloat16, 16
    seqs = _decode_seqs(8, 600, seed=3)
    args, scales = _attention_batch(seqs, dtype, cache_dtype, block_size)
    q, k_cache, v_cache, tables, lens, starts = args
    # This step's k, v go to each sequence's last slot (its decode token), as the engine writes then attends.
    last = lens.long() - 1
    slots = tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(len(seqs), KV_HEADS, HEAD_DIM, generator=gen).to("cuda", dtype) for _ in range(2))
    angles = torch.rand(len(seqs), HEAD_DIM // 2, generator=gen).cuda() * 3
    cos, sin = angles.cos(), angles.sin()
    start_k, start_v = k_cache.clone(), v_cache.clone()

    def step():  # one decode layer through the public ops, as model_defs/layers/attention.py calls them
        q_rot = rotary_embedding_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, *scales)
        return paged_attention(q_rot, k_cache, v_cache, tables, lens, starts, HEAD_DIM ** -0.5, 0, *scales)

    graph, out = capture(step)
    k_cache.copy_(start_k)
    v_cache.copy_(start_v)
    graph.replay()
    torch.cuda.synchronize()

    want_k, want_v = start_k.clone(), start_v.clone()
    q_rot = rotary_embedding_and_write_kv_triton(q, k, v, cos, sin, want_k, want_v, slots, *scales)
    want = paged_attention_triton(q_rot, want_k, want_v, tables, lens, starts, HEAD_DIM ** -0.5, 0, *scales)
    _assert_same_bytes(k_cache, want_k, "k cache")
    _assert_same_bytes(v_cache, want_v, "v cache")
    assert torch.equal(out, want)


def test_decode_over_a_one_byte_cache_runs_two_warps_a_program():
    # Measured on an H100 (scripts/bench_attention.py --sweep): 20% faster for an FP8 cache, no change for bf16.
    from kiln.plugins.triton_attention import _launch_config

    fp8 = _launch_config(1024, 1024, 8, 4, 128, 2, 4224, 132, decode=True, kv_element_size=1)
    bf16 = _launch_config(1024, 1024, 8, 4, 128, 2, 4224, 132, decode=True, kv_element_size=2)
    assert (fp8.num_warps, bf16.num_warps) == (2, 4)
    assert _launch_config(1024, 4, 8, 4, 128, 2, 4224, 132, decode=False, kv_element_size=1).num_warps >= 4

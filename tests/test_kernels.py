"""The Triton kernels (plugins/triton_*.py) against their PyTorch references, both on CUDA.

The kernels round in the references' order, so outputs are expected bit for bit (torch.equal); RMSNorm
sums its squares in another order than torch's reduction, so it is allowed rare differences of an ulp or two.
Shapes are few on purpose: each new block size or dtype compiles a kernel.
"""

from __future__ import annotations

import pytest
import torch

from kiln.model_defs.config import RopeConfig
from kiln.model_defs.layers.rotary import RotaryTables
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.activation import silu_and_mul_reference
from kiln.plugins.kv_cache import write_kv_cache_reference
from kiln.plugins.norm import rms_norm_reference
from kiln.plugins.rotary import rotary_embedding_reference
from kiln.plugins.rotary_kv import rotary_embedding_and_write_kv_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not USE_TRITON, reason="triton is missing or KILN_DISABLE_TRITON=1"),
]

if USE_TRITON:
    from kiln.plugins.triton_activation import silu_and_mul_triton
    from kiln.plugins.triton_norm import fused_add_rms_norm_triton, rms_norm_triton
    from kiln.plugins.triton_rotary_kv import (
        rotary_embedding_and_write_kv_triton,
        rotary_embedding_triton,
        write_kv_cache_triton,
    )

DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-5
LLAMA3_ROPE = RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192)


def _assert_norm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # A different summation order can move mean(x^2) by an ulp of float32, which flips the dtype rounding of
    # x * rsqrt(...) for about one element in 10^4 (fp16) to 10^5 (bf16): one ulp there, up to two after the
    # weight multiply rounds. Rounding the weight product in another order than the reference would instead
    # change a large share of the elements, which the count of mismatches catches.
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=3 * torch.finfo(ref.dtype).eps, atol=1e-6)
    assert (out != ref).sum().item() <= 2 + out.numel() // 1000


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 384, 4096, 5120, 8192])
@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
def test_rms_norms_match_reference(dtype, hidden, rows):
    torch.manual_seed(hidden + rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype) * 3
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    _assert_norm_close(rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)
    _assert_norm_close(normed, rms_norm_reference(x + residual, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_strided_head_views(dtype):
    # Qwen3 normalizes each head of q and k, views into the fused qkv output: strides (qkv_width, D, 1).
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 300, 32, 8, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    weight = torch.randn(dim, device="cuda", dtype=dtype)
    for t in (q, k):
        out = rms_norm_triton(t, weight, 1e-6)
        assert out.stride() == torch.empty_like(t).stride()  # what the fake implementation promises
        _assert_norm_close(out, rms_norm_reference(t, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1024, 14336, 1000])
@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
def test_silu_and_mul_matches_reference(dtype, inter, rows):
    torch.manual_seed(inter + rows)
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype) * 4
    assert torch.equal(silu_and_mul_triton(x), silu_and_mul_reference(x))


def _rotary_case(dtype, heads, kv_heads, dim, block_size, tokens=37):
    """Strided q, k, v views of one fused qkv output, llama3-scaled cos/sin, slots with -1 rows."""
    gen = torch.Generator().manual_seed(dim + block_size)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to("cuda", dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    tables = RotaryTables(LLAMA3_ROPE, dim, 131072, 8192, "cuda")
    positions = torch.randint(0, 8192, (tokens,), generator=gen).cuda()
    cos, sin = tables.cos[positions], tables.sin[positions]
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # padding tokens of a captured graph
    return q, k, v, cos, sin, slots.cuda(), num_blocks


def _assert_all_equal(got, want) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), f"output {i}: {a.shape} {a.dtype}"
        assert torch.equal(a, b), f"output {i}: {(a != b).sum().item()} of {a.numel()} elements differ"


def _caches(num_blocks, block_size, kv_heads, dim, dtype):
    # Random contents, so that a write to a wrong or skipped slot shows.
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda").to(dtype)
    return k_cache, torch.randn_like(k_cache)


def _assert_fused_rotary_kv_matches(q, k, v, cos, sin, slots, k_cache, v_cache) -> None:
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    out_q = rotary_embedding_and_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    ref_q = rotary_embedding_and_write_kv_reference(q, k, v, cos, sin, ref_k_cache, ref_v_cache, slots)
    _assert_all_equal((out_q, k_cache, v_cache), (ref_q, ref_k_cache, ref_v_cache))


# (Hq, Hk, D): Llama-8B, then head dims 64, 256 and an odd one (masked lanes).
ROTARY_SHAPES = [(32, 8, 128), (8, 2, 64), (16, 4, 256), (8, 2, 80)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", ROTARY_SHAPES)
@pytest.mark.parametrize("block_size", [16, 128])
def test_rotary_and_kv_kernels_match_references(dtype, heads, kv_heads, dim, block_size):
    q, k, v, cos, sin, slots, num_blocks = _rotary_case(dtype, heads, kv_heads, dim, block_size)
    out_q, out_k = rotary_embedding_triton(q, k, cos, sin)
    ref_q, ref_k = rotary_embedding_reference(q, k, cos, sin)
    _assert_all_equal((out_q, out_k), (ref_q, ref_k))

    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, dim, dtype)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    write_kv_cache_reference(k, v, ref_k_cache, ref_v_cache, slots)
    _assert_all_equal((k_cache, v_cache), (ref_k_cache, ref_v_cache))

    caches = _caches(num_blocks, block_size, kv_heads, dim, dtype)
    _assert_fused_rotary_kv_matches(q, k, v, cos, sin, slots, *caches)


# float32 activations also check that the kernel does not contract x * cos + y * sin into an FMA.
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16)])
def test_fused_rotary_kv_casts_to_the_cache_dtype(dtype, cache_dtype):
    q, k, v, cos, sin, slots, num_blocks = _rotary_case(dtype, 32, 8, 128, 16)
    _assert_fused_rotary_kv_matches(q, k, v, cos, sin, slots, *_caches(num_blocks, 16, 8, 128, cache_dtype))


def test_ops_dispatch_to_the_kernels_on_cuda():
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache",
               "rotary_embedding_and_write_kv"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CUDA"), op
    # The kernels match the references bit for bit, so results alone cannot tell which ran; they must at
    # least equal the launchers'.
    torch.manual_seed(0)
    x = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(torch.ops.kiln.rms_norm(x, weight, EPS), rms_norm_triton(x, weight, EPS))
    _assert_all_equal(torch.ops.kiln.fused_add_rms_norm(x, x, weight, EPS),
                      fused_add_rms_norm_triton(x, x, weight, EPS))
    gate_up = torch.randn(7, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(torch.ops.kiln.silu_and_mul(gate_up), silu_and_mul_triton(gate_up))

    q, k, v, cos, sin, slots, num_blocks = _rotary_case(torch.bfloat16, 32, 8, 128, 16)
    _assert_all_equal(torch.ops.kiln.rotary_embedding(q, k, cos, sin),
                      rotary_embedding_triton(q, k, cos, sin))
    caches = [_caches(num_blocks, 16, 8, 128, torch.bfloat16) for _ in range(2)]
    op_caches, launcher_caches = caches[0], tuple(c.clone() for c in caches[0])
    torch.ops.kiln.write_kv_cache(k, v, *op_caches, slots)
    write_kv_cache_triton(k, v, *launcher_caches, slots)
    _assert_all_equal(op_caches, launcher_caches)
    op_caches, launcher_caches = caches[1], tuple(c.clone() for c in caches[1])
    assert torch.equal(torch.ops.kiln.rotary_embedding_and_write_kv(q, k, v, cos, sin, *op_caches, slots),
                       rotary_embedding_and_write_kv_triton(q, k, v, cos, sin, *launcher_caches, slots))
    _assert_all_equal(op_caches, launcher_caches)

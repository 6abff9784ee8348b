"""A mixed step's decode rows attend apart from its prompts on the GPU (model_defs/layers/decode_prefix.py): the
split is found from the host lists, and the two kernel calls give the reference's attention."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import needs_triton, run_interpreted

from kiln.model_defs.layers.decode_prefix import DecodePrefix, decode_prefix


def _qsl(lens):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


def test_leading_decode_rows_are_split_from_the_rest():
    lens = [1, 1, 1, 37, 1, 20]
    split = decode_prefix(lens, _qsl(lens), has_tree=False)
    assert split.num_decode == 3
    assert split.rest_query_start_loc.tolist() == [0, 37, 38, 58]
    assert split.rest_query_start_loc.dtype == torch.int32


@pytest.mark.parametrize("lens, tree", [(None, False), ([1, 1, 1], False), ([37, 1, 1], False),
                                        ([1, 37], True), ([5], False)],
                         ids=["graph-context", "decode-only", "prompt-first", "tree", "one-prompt"])
def test_nothing_to_split(lens, tree):
    assert decode_prefix(lens, _qsl(lens or [1]), has_tree=tree) is None


def test_cpu_steps_keep_one_call():
    """The reference groups decode rows itself: an eager CPU context has no split."""
    from kiln.model_defs.layers import ForwardContext

    lens = [1, 1, 4]
    ctx = ForwardContext(positions=torch.zeros(6, dtype=torch.long), rope_lengths=torch.ones(6, dtype=torch.long),
                         slot_mapping=torch.arange(6), block_tables=torch.zeros(3, 4, dtype=torch.int32),
                         seq_lens=torch.tensor([3, 3, 4], dtype=torch.int32), query_start_loc=_qsl(lens),
                         kv_caches=(), host_query_lens=tuple(lens), host_seq_lens=(3, 3, 4))
    assert ctx.decode_prefix is None


def test_attend_concatenates_the_two_calls_in_row_order():
    lens = [1, 1, 3]
    split = DecodePrefix(2, _qsl(lens)[2:] - 2)
    seen = []

    def attention(q, tables, seq_lens, qsl):
        seen.append((q.shape[0], tables.shape[0], seq_lens.tolist(), qsl.tolist()))
        return q * 2

    q = torch.arange(5.0).view(5, 1, 1)
    out = split.attend(attention, q, torch.zeros(3, 4, dtype=torch.int32), torch.tensor([4, 9, 6]), _qsl(lens))
    assert torch.equal(out, q * 2)
    assert seen == [(2, 2, [4, 9], [0, 1, 2]), (3, 1, [6], [0, 3])]


# A batch-1024-like mixed step in miniature: decode rows first (running requests), then prompts and a chunk after a
# cached prefix; float32 (the interpreter) and an FP8 cache.
SPLIT_CHECK = """
import torch
from kiln.model_defs.layers.decode_prefix import decode_prefix
from kiln.plugins.attention import paged_attention_reference
from kiln.plugins.triton_attention import paged_attention_triton

torch.manual_seed(0)
device = "{device}"
seqs = [(40, 1), (3, 1), (150, 1), (0, 1), (77, 1), (0, 37), (50, 20), (0, 1 + 16)]  # (cached, new)
heads, kv_heads, dim, block = 8, 2, 64, 16
lengths = [c + n for c, n in seqs]
blocks = sum(-(-n // block) for n in lengths) + 2
cache_dtype = {cache_dtype}
k_cache = (torch.randn(blocks, block, kv_heads, dim, device=device) * 3).to(cache_dtype)
v_cache = (torch.randn(blocks, block, kv_heads, dim, device=device) * 3).to(cache_dtype)
free = torch.randperm(blocks).tolist()
tables = [[free.pop() for _ in range(-(-n // block))] for n in lengths]
width = max(map(len, tables))
tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
query_lens = [n for _, n in seqs]
qsl = torch.tensor([0] + query_lens, device=device).cumsum(0).to(torch.int32)
q = torch.randn(int(qsl[-1]), heads, dim, device=device, dtype={q_dtype})
scales = (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device)) if cache_dtype != q.dtype else ()
split = decode_prefix(query_lens, qsl, has_tree=False)
assert split.num_decode == 5, split

def attention(q, tables, seq_lens, qsl):
    return paged_attention_triton(q, k_cache, v_cache, tables, seq_lens, qsl, dim ** -0.5, 0, *scales)

got = split.attend(attention, q, tables, seq_lens, qsl)
whole = attention(q, tables, seq_lens, qsl)
ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, qsl, dim ** -0.5, 0, *scales)
assert got.shape == q.shape and got.dtype == q.dtype
tol = {tol}
torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
torch.testing.assert_close(got.float(), whole.float(), atol=tol, rtol=tol)
print("ok")
"""


@needs_triton
@pytest.mark.parametrize("cache", ["float32", "float8_e4m3fn"])
def test_split_kernels_match_the_reference_interpreted(cache):
    script = SPLIT_CHECK.format(device="cpu", cache_dtype=f"torch.{cache}", q_dtype="torch.float32", tol=1e-4)
    assert "ok" in run_interpreted(script)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_split_kernels_match_the_reference_on_cuda(cache):
    script = SPLIT_CHECK.format(device="cuda", cache_dtype=f"torch.{cache}", q_dtype="torch.bfloat16", tol=2e-2)
    exec(compile(script, "split_check", "exec"), {})

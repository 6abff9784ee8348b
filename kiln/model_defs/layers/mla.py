"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token and layer the cache holds one "head" of kv_lora_rank + qk_rope_head_dim values: the normalized
compressed kv (c) and the rotated shared rope key (k_pe). Keys and values are never cached per head:

    k_h = [W_UK_h c ; k_pe]   v_h = W_UV_h c        (W_UK_h, W_UV_h: head h's rows of kv_b_proj)
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe

so attention runs with the up-projections absorbed: each head's query is taken into latent space
(q_lat_h = W_UK_h^T q_nope_h, [kv_lora_rank]) and attends over the latent cache as multi-query attention with
head dim kv_lora_rank + rope dim (`kiln::mla_attention`, plugins/mla_attention.py: the paged-attention reference
on the CPU, a Triton kernel reading each cached row once on CUDA); the output goes through W_UV_h. That is the
memory win of decode, but a long prompt pays ~3.4x the explicit form's attention FLOPs for it: in an eager step
the sequences of at least `EXPLICIT_MIN_QUERY` queries (mla_split.py) are computed explicitly instead
(mla_prefill.py: every key's latent up-projected in one GEMM, flash attention with head dims 192 / 128), the
other rows absorbed; CUDA-graph steps (no host lengths) and tree verification stay absorbed throughout.
`explicit_attention` is the per-sequence form transformers runs, which tests hold both paths equal to.

Tensor parallelism splits the heads (q_b_proj / q_proj and kv_b_proj column-parallel by whole heads, o_proj
row-parallel); the latent projections and the cache are replicated on every rank.

Parameter names are the checkpoint's (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj). The rope parts rotate in rotate_half's layout (halves): a checkpoint in
DeepSeek's interleaved layout (`MLAConfig.rope_interleave`) has those rows reordered at build (deepseek.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kiln.plugins import mla_attention, rotary_embedding, write_kv_cache
from kiln.plugins.step_plan import StepPlan

from ..config import ModelConfig
from .context import ForwardContext
from .linear import LinearFactory
from .mla_prefill import explicit_prefill
from .norm import RMSNorm
from .rotary import yarn_softmax_mscale

# transformers' DeepseekV2RMSNorm / DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are made without
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """x [T, H] -> [T, H]: DeepSeek's attention sublayer over the step's paged latent cache
    (`ForwardContext.kv_caches[layer]`: both entries the one [N, block_size, 1, kv_lora_rank + rope] cache).
    `forward` runs the absorbed form, and the explicit one for an eager step's long sequences (mla_prefill.py);
    `explicit_attention` is the per-head form both are checked against."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError(f"{config.architecture}: MLAttention needs config.mla")
        if linears.quant is not None and mla.fp8_block_size is None:
            raise ValueError(f"{config.architecture}: quantized MLA engines are supported from block-scaled FP8 "
                             f"checkpoints only (DeepSeek-V3's release); build without --qformat")
        tp = linears.tp_size
        if config.num_heads % tp:
            raise ValueError(f"{prefix}: num_attention_heads={config.num_heads} is not divisible by tp_size={tp}")
        self.mla = mla
        self.layer_index = layer_index
        self.num_heads = config.num_heads // tp  # this rank's heads
        hidden, heads = config.hidden_size, config.num_heads
        bias = config.o_bias  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj, as transformers
        q_out = heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = linears.replicated(f"{prefix}.q_a_proj", hidden, mla.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, linears.dtype)
            self.q_b_proj = linears.column(f"{prefix}.q_b_proj", mla.q_lora_rank, q_out)
        else:
            self.q_proj = linears.column(f"{prefix}.q_proj", hidden, q_out)
        self.kv_a_proj_with_mqa = linears.replicated(f"{prefix}.kv_a_proj_with_mqa", hidden, mla.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, linears.dtype)
        # Never applied as a layer: its weight [H (dn + dv), r] is read per head as W_UK, W_UV, so it is float
        # in every engine (an FP8 checkpoint's is dequantized at build, deepseek.py's recipes).
        self.kv_b_proj = dataclasses.replace(linears, quant=None).column(
            f"{prefix}.kv_b_proj", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = linears.row(f"{prefix}.o_proj", heads * mla.v_head_dim, hidden, bias)
        self.scale = mla.qk_head_dim ** -0.5 * yarn_softmax_mscale(config.rope)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [Hl, dn, r], W_UV [Hl, dv, r]): views of this rank's kv_b_proj weight."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, :mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (q_nope [T, Hl, dn], rotated q_pe [T, Hl, dr], latent [T, 1, r + dr]: normalized c and
        the rotated k_pe, what the cache stores)."""
        mla = self.mla
        num_tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if mla.q_lora_rank else self.q_proj(x)
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())  # [T, r]
        k_pe = k_pe[:, None, :]  # [T, 1, dr]; the rope parts' rows are in halves layout (deepseek.py's recipes)
        q_pe, k_pe = rotary_embedding(q_pe.contiguous(), k_pe.contiguous(), cos, sin)
        return q_nope, q_pe, torch.cat([c[:, None, :], k_pe], dim=-1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, dr/2] float32
        q_nope, q_pe, latent = self.project(x, cos, sin)
        cache, _ = ctx.kv_caches[self.layer_index]  # [N, block_size, 1, r + dr]: keys and values alike
        if ctx.kv_scales is not None:
            raise ValueError("a quantized (FP8 / INT8) KV cache is not supported with MLA; use a float cache")
        plan = ctx.plan
        write_kv_cache(latent, latent, cache, cache, ctx.slot_mapping, plan=plan)
        split = ctx.mla_split  # the step's long sequences, computed explicitly (mla_split.py); None: none
        if split is None:
            o = self.absorbed(q_nope, q_pe, cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, plan)
        else:
            o = q_nope.new_empty(x.shape[0], self.num_heads, self.mla.v_head_dim)  # [T, Hl, dv]
            if split.absorbed is not None:  # the other sequences, as a step of their own
                rest = split.absorbed
                o.index_copy_(0, rest.rows, self.absorbed(
                    q_nope.index_select(0, rest.rows), q_pe.index_select(0, rest.rows), cache, rest.block_tables,
                    rest.seq_lens, rest.query_start_loc, rest.plan))
            explicit_prefill(q_nope, q_pe, cache, self.kv_b_proj.weight, self.mla, self.scale, split, o)
        return self.o_proj(o.reshape(x.shape[0], -1))

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan: StepPlan | None) -> torch.Tensor:
        """The absorbed form over the latent cache: q_nope [T, Hl, dn], q_pe [T, Hl, dr] (rotated) of the step
        the paging tensors describe -> [T, Hl, dv] (before o_proj)."""
        w_uk, w_uv = self.up_projections()
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, Hl, r]
        out = mla_attention(q_lat, q_pe, cache, block_tables, seq_lens, query_start_loc, self.scale,
                            plan=plan)  # [T, Hl, r]
        return torch.einsum("thr,hvr->thv", out, w_uv)  # [T, Hl, dv]

    def explicit_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                           block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The explicit form for one sequence whose n queries are its last positions: k and v of every head
        up-projected from the cached latent (as transformers computes them), causal softmax attention.
        q_nope: [n, Hl, dn]; q_pe: [n, Hl, dr]; cache: [N, block_size, 1, r + dr]; block_table: [max_blocks]
        -> [n, Hl, dv] float32 (before o_proj)."""
        mla, block_size = self.mla, cache.shape[1]
        slots = torch.arange(seq_len, device=cache.device)
        rows = block_table.long()[slots // block_size] * block_size + slots % block_size
        latent = cache.view(-1, mla.latent_dim).index_select(0, rows).float()  # [L, r + dr]
        c, k_pe = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = (w.float() for w in self.up_projections())
        k_nope = torch.einsum("lr,hdr->hld", c, w_uk)  # [Hl, L, dn]
        v = torch.einsum("lr,hvr->hlv", c, w_uv)  # [Hl, L, dv]
        k = torch.cat([k_nope, k_pe[None].expand(self.num_heads, -1, -1)], dim=-1)  # [Hl, L, dn + dr]
        q = torch.cat([q_nope, q_pe], dim=-1).float().transpose(0, 1)  # [Hl, n, dn + dr]
        n = q.shape[1]
        mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)  # query i sees <= L-n+i
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [Hl, n, dv]
        return out.transpose(0, 1)

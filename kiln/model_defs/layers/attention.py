"""Self-attention with fused QKV, optional q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection
(OLMo 2), rotary, paged KV cache, optional score soft-capping (Gemma 2), optional attention sinks (GPT-OSS)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.plugins import paged_attention, rotary_embedding_and_write_kv

from ..config import ModelConfig
from .context import ForwardContext
from .fp8_input import Fp8Input
from .linear import LinearFactory
from .norm import ProjectionRMSNorm, RMSNorm
from .parallel import FeatureShard


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str,
                 norm: Callable[[int, float, torch.dtype], nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = config.head_dim
        # Granite's attention_multiplier (Gemma's query_pre_attn_scalar ** -0.5) replaces 1/sqrt(head_dim).
        self.scale = config.attention_multiplier or config.head_dim ** -0.5
        self.softcap = config.attn_logit_softcapping  # Gemma 2; 0: off
        self.sliding_window = config.layer_sliding_windows[layer_index]
        # [q; k; v] rows of this rank's heads (all of them without tensor parallelism)
        self.qkv_proj = linears.attention_qkv(f"{prefix}.qkv_proj", config.hidden_size, config.num_heads,
                                              config.num_kv_heads, config.head_dim, config.qkv_bias)
        self.split_sizes = self.qkv_proj.output_sizes
        self.num_heads = self.split_sizes[0] // config.head_dim
        self.num_kv_heads = self.split_sizes[1] // config.head_dim
        self.o_proj = linears.row(f"{prefix}.o_proj", config.num_heads * config.head_dim, config.hidden_size,
                                  config.o_bias)
        self.sinks = self.shard = None
        if config.attention_sinks:  # GPT-OSS: one logit per query head, float32 as the op reads it: [local Hq]
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            if self.qkv_proj.shard is not None:  # this rank's query heads: how the builder cuts `sinks`
                start = self.qkv_proj.shard.slices[0][0] // config.head_dim
                self.shard = FeatureShard("output", (config.num_heads,), ((start, self.num_heads),))
        self.norm_projection = config.qk_norm and config.qk_norm_scope == "projection"
        if self.norm_projection:  # over this rank's q (k) rows, its share of the whole projection's norm
            shard = self.qkv_proj.shard  # None: one rank, which holds the whole projections
            sizes = self.split_sizes if shard is None else shard.full_sizes  # whole q, k, v widths
            self.q_norm, self.k_norm = (
                ProjectionRMSNorm(sizes[i], config.rms_norm_eps, linears.dtype,
                                  None if shard is None else FeatureShard("output", (sizes[i],), (shard.slices[i],)),
                                  linears.comm) for i in (0, 1))
        elif config.qk_norm:  # per head, as the layer's norm (`norm`: Gemma 3's (1 + weight) RMSNorm)
            self.q_norm = norm(config.head_dim, config.rms_norm_eps, linears.dtype)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps, linears.dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor | Fp8Input, ctx: ForwardContext, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (or its FP8 quantization for an FP8 qkv_proj); cos, sin: [T, D/2] float32
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) D]
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        if self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)  # [T, Hq D], [T, Hk D]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        # A quantized cache's per-layer scales ([1] float32 each); None, None for a float cache.
        k_scale, v_scale = (None, None) if ctx.kv_scales is None else ctx.kv_scales[self.layer_index]
        plan = ctx.plan  # the step's metadata worked out once for every layer where the references run
        q = rotary_embedding_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, ctx.slot_mapping,
                                          k_scale, v_scale, plan=plan)  # k, v cached
        def attend(q, block_tables, seq_lens, query_start_loc):  # [t, Hq, D] -> [t, Hq, D]
            return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, self.scale,
                                   self.sliding_window, k_scale, v_scale, self.softcap, self.sinks, ctx.tree_mask,
                                   plan=plan)

        split = ctx.decode_prefix  # a mixed step's decode rows apart from its prompts (decode_prefix.py)
        if split is None:
            out = attend(q, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc)  # [T, Hq, D]
        else:
            out = split.attend(attend, q, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc)
        return self.o_proj(out.view(num_tokens, -1))

"""Rotary angle tables for each rope scaling scheme (default, linear, dynamic NTK, llama3, yarn, longrope), over
the rotated dimensions of a head (all of them, or the first rotary_dim under partial rotary).

Frequencies are computed exactly as Hugging Face computes them (same float32 operations), so rotated
queries and keys match transformers bit for bit on the CPU.
"""

from __future__ import annotations

import math

import torch

from ..config import RopeConfig
from ..rope_params import longrope_attention_factor, rotary_dim


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                        seq_len: int | None = None) -> torch.Tensor:
    """inv_freq: [R / 2] float32, R the rotated dimensions (head_dim, or less under partial rotary).
    `seq_len` matters only for dynamic NTK scaling and longrope (long factors past the original length)."""
    head_dim = rotary_dim(rope.partial_rotary_factor, head_dim)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    base = rope.theta
    if rope.rope_type == "longrope":
        # transformers' _compute_longrope_parameters: 1 / (ext_factors * base ** exponents)
        long = seq_len is not None and seq_len > rope.original_max_position_embeddings
        ext_factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (ext_factors * base ** exponents)
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim, base ** exponents)
    if rope.rope_type == "dynamic":
        # NTK-aware: grow the base once the sequence outgrows the trained context.
        # Same float32 tensor arithmetic as transformers, so the base rounds the same way.
        if seq_len is not None and seq_len > max_position_embeddings:
            length = torch.tensor(seq_len, dtype=torch.int64)
            base = base * ((rope.factor * length / max_position_embeddings) - (rope.factor - 1)) ** (
                head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(rope: RopeConfig, head_dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    # transformers' _compute_yarn_parameters, same float32 operations in the same order: dimensions that turn
    # more than beta_fast times over the original context keep their frequency (extrapolation), those that
    # turn fewer than beta_slow times are divided by `factor` (interpolation), a linear ramp in between.
    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                ) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    interpolated = 1.0 / (rope.factor * pos_freqs)
    extrapolated = 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_factor) + extrapolated * extrapolation_factor


def attention_scaling(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by: yarn's and longrope's `attention_factor` (given, or
    inferred from factor (yarn: and mscale, mscale_all_dim; longrope: and the original length) as transformers
    infers it); 1 for every other type."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "longrope":
        return longrope_attention_factor(rope.factor, rope.original_max_position_embeddings)

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim))
    return get_mscale(rope.factor)


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's correction of the attention softmax scale under YaRN (transformers' yarn_apply_mscale): the
    scale is multiplied by (0.1 * mscale_all_dim * ln(factor) + 1) ** 2 when mscale_all_dim is set and
    factor > 1; 1 otherwise."""
    if rope.rope_type != "yarn" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
    return mscale * mscale


class RotaryTables:
    """cos/sin per token for one model, [*, R/2] with R the rotated dimensions of a head. Built once on the
    runtime's device for max_positions.

    LongRoPE keeps two tables, short factors then long factors, one above the other. A token uses the long
    one when its sequence's rope length (`ForwardContext.rope_lengths`: the prompt's length for prompt tokens,
    position + 1 after) exceeds original_max_position_embeddings, as transformers picks per forward by the
    sequence length: a prompt longer than the original context runs on long factors throughout. The choice
    is per token on the device, so a step of many requests (in-flight batching, chunked prefill) gives each
    request its own table, never its neighbours', and CUDA graphs replay it. One difference from
    transformers' generate: when a sequence whose prompt fits the original context grows past it,
    transformers drops its cache and recomputes the whole sequence on long factors (Phi3ForCausalLM's
    prepare_inputs_for_generation); kiln keeps the keys already cached (short factors) and computes the new
    tokens on long factors (no recompute), so tokens generated past that point can differ from transformers'.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, max_positions: int,
                 device: torch.device | str) -> None:
        self.rope = rope
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = inverse_frequencies(rope, head_dim, max_position_embeddings).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, R/2] float32
        # longrope: the long factors' rows follow the short ones' ([2 max_positions, R/2]) where a sequence
        # can outgrow the original context; lookup adds max_positions to the long tokens' rows.
        self.long_offset = 0
        if rope.rope_type == "longrope" and max_positions > rope.original_max_position_embeddings:
            long_inv_freq = inverse_frequencies(rope, head_dim, max_position_embeddings,
                                                rope.original_max_position_embeddings + 1).to(device)
            freqs = torch.cat([freqs, torch.outer(positions, long_inv_freq)])
            self.long_offset = max_positions
        # Allocated once; read by index every step (and by captured graphs later). Yarn's attention factor
        # is folded into the tables as transformers folds it into its cos/sin (float32, before the cast).
        self.cos = freqs.cos()
        self.sin = freqs.sin()
        scale = attention_scaling(rope)
        if scale != 1.0:
            self.cos, self.sin = self.cos * scale, self.sin * scale

    def needs_per_length_tables(self, max_rope_length: int) -> bool:
        """Whether a step whose longest rope length is this needs more than the fixed tables."""
        return self.rope.rope_type == "dynamic" and max_rope_length > self.max_position_embeddings

    def lookup(self, positions: torch.Tensor, rope_lengths: torch.Tensor,
               max_rope_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions, rope_lengths: [T] int64 -> cos, sin: [T, R/2] float32. max_rope_length is
        max(rope_lengths), given by the caller so that the common case needs no host sync."""
        if self.long_offset:  # longrope: the long table's rows for tokens of sequences past the original length
            long = rope_lengths > self.rope.original_max_position_embeddings
            positions = positions + long * self.long_offset
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        if not self.needs_per_length_tables(max_rope_length):
            return cos, sin
        # Dynamic NTK: tokens of sequences longer than the trained context use a larger base.
        long = rope_lengths > self.max_position_embeddings
        cos, sin = cos.clone(), sin.clone()
        for length in rope_lengths[long].unique().tolist():
            rows = (rope_lengths == length).nonzero().squeeze(1)
            inv_freq = inverse_frequencies(self.rope, self.head_dim, self.max_position_embeddings, length)
            freqs = torch.outer(positions[rows].float(), inv_freq.to(positions.device))
            cos[rows] = freqs.cos()
            sin[rows] = freqs.sin()
        return cos, sin

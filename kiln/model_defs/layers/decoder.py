"""The Llama-family decoder: the one network behind every model file (Llama, Mistral, Qwen2, Qwen3).

Parameter names follow Hugging Face's module tree, except that q/k/v and gate/up projections are fused
(`qkv_proj`, `gate_up_proj`); `model_defs/recipes.py` says which checkpoint tensors each one is made of.
Every linear comes from the LinearFactory and the MLP block from the model def's MLP factory, so
quantization, sharding and MoE change what those return, not this file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention
from .context import ForwardContext
from .linear import LinearFactory
from .mlp import GatedMLP, MLPFactory
from .norm import RMSNorm
from .parallel import VocabParallelEmbedding
from .rotary import RotaryTables

# (size, eps, dtype) -> a norm with forward(x), add_and_norm(x, residual) and feeds(linear): RMSNorm, LayerNorm.
NormFactory = Callable[[int, float, torch.dtype], nn.Module]


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(.)); `norm` is the layer option (Starcoder2: LayerNorm)."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, mlp: MLPFactory,
                 prefix: str, norm: NormFactory = RMSNorm) -> None:
        super().__init__()
        eps, dtype = config.rms_norm_eps, linears.dtype
        self.input_layernorm = norm(config.hidden_size, eps, dtype)
        self.self_attn = Attention(config, layer_index, linears, f"{prefix}.self_attn", norm)
        self.post_attention_layernorm = norm(config.hidden_size, eps, dtype)
        self.mlp = mlp(config, layer_index, linears, f"{prefix}.mlp")
        # An FP8 qkv/gate_up projection gets its input quantized by the norm kernel (fp8_input.py); an MoE block
        # has no gate_up_proj of its own.
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        self.post_attention_layernorm.feeds(getattr(self.mlp, "gate_up_proj", None))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H]. The residual add of the previous sublayer is fused into this norm.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, ctx, cos, sin)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig, linears: LinearFactory, mlp: MLPFactory, prefix: str,
                 layer: type[nn.Module] = DecoderLayer, norm: NormFactory = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, linears.dtype,
                                                   linears.mapping, linears.comm)
        self.layers = nn.ModuleList(layer(config, i, linears, mlp, f"{prefix}.layers.{i}", norm)
                                    for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps, linears.dtype)


class DecoderForCausalLM(nn.Module):
    """input_ids: [T] (packed tokens of many sequences) -> hidden states [T, H]; logits on demand.

    Implements `model_defs.protocol.CausalLM`; build it with `build_network`. A model file's subclass may set
    the layer options: `layer_class` (made like DecoderLayer; its forward returns (x, residual) whose sum is
    the layer's output) and `norm_class` (every norm's NormFactory).
    """

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: NormFactory = RMSNorm

    def __init__(self, config: ModelConfig, linears: LinearFactory | None = None,
                 mlp: MLPFactory = GatedMLP) -> None:
        super().__init__()
        linears = linears or LinearFactory()
        self.config = config
        self.model = DecoderBody(config, linears, mlp, "model", self.layer_class, self.norm_class)
        # Tied models read the embedding matrix; the engine stores it once.
        tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = linears.lm_head("lm_head", config.hidden_size, config.vocab_size, tied_to)
        self.rotary: RotaryTables | None = None
        self.sliding_rotary: RotaryTables | None = None  # config.sliding_rope's tables (Gemma 3's local layers)
        # Granite's multiplier; a family may round it (Gemma: sqrt(hidden) in the embedding's dtype).
        self.embedding_multiplier = config.embedding_multiplier

    def setup_rotary(self, max_positions: int, device: torch.device | str) -> None:
        """Builds the rotary tables on the runtime device; call once after loading weights."""
        c = self.config
        self.rotary = RotaryTables(c.rope, c.head_dim, c.max_position_embeddings, max_positions, device)
        if c.sliding_rope is not None:
            self.sliding_rotary = RotaryTables(c.sliding_rope, c.head_dim, c.max_position_embeddings, max_positions,
                                               device)

    def needs_per_length_rope(self, max_rope_length: int) -> bool:
        """Whether a step whose longest rope length is this needs per-length rope tables (dynamic NTK past
        the trained context), which CUDA graphs cannot capture. False before setup_rotary."""
        return any(t is not None and t.needs_per_length_tables(max_rope_length)
                   for t in (self.rotary, self.sliding_rotary))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.rotary is None:
            raise RuntimeError("call setup_rotary() before the first forward")
        angles = self.rotary.lookup(ctx.positions, ctx.rope_lengths, ctx.max_rope_length)  # cos, sin: [T, D/2]
        sliding = angles if self.sliding_rotary is None else \
            self.sliding_rotary.lookup(ctx.positions, ctx.rope_lengths, ctx.max_rope_length)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        if self.embedding_multiplier != 1.0:  # Granite, Gemma
            x = x * self.embedding_multiplier
        residual = None
        for i, (layer, window) in enumerate(zip(self.model.layers, self.config.layer_sliding_windows)):
            if i in ctx.capture_layers:  # EAGLE-3's features: the residual stream entering layer i
                ctx.captured[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, ctx, *(sliding if window else angles))
        if len(self.model.layers) in ctx.capture_layers:
            ctx.captured[len(self.model.layers)] = x + residual
        x, _ = self.model.norm.add_and_norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, H] -> logits: [N, V] float32, written into `out` ([N, V] float32) when given."""
        logits = self.lm_head(hidden)
        logits = logits.float() if out is None else out.copy_(logits)
        # Granite divides its logits by logits_scaling; Gemma 2 caps them. In place: `logits` is ours (a new
        # float32 tensor or `out`), and a CUDA graph's output must stay in `out`.
        if self.config.logits_scaling != 1.0:
            logits.div_(self.config.logits_scaling)
        if cap := self.config.final_logit_softcapping:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

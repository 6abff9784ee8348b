"""The EAGLE-3 head's architecture: its config, the torch module, and the published layout's tensors mapped onto
the module's (fused) ones. Here, below both, because the builder writes a head engine and the runtime runs it.

The layout is the one published for Llama-3.1-8B-Instruct (`LlamaForCausalLMEagle3`): `fc` [H, 3H'] fuses the
target's residual streams at three layers (H' the target's hidden size), one decoder layer `midlayer.*` whose
attention reads [input_layernorm(embedding); hidden_norm(features)] (2H wide), `norm`, an `lm_head` over a draft
vocabulary of `draft_vocab_size` tokens, and `d2t` (draft id -> target id - draft id) / `t2d` (which target ids
the draft vocabulary holds). The embedding is the head's own `embed_tokens` when it has one, else the target's.
A head whose config names `eagle_aux_hidden_state_layer_ids` reads those layers; else (2, L // 2, L - 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.engine_format import EngineError
from kiln.model_defs.config import ModelConfig, ModelConfigError, parse_decoder_config
from kiln.model_defs.layers.attention import Attention
from kiln.model_defs.layers.context import ForwardContext
from kiln.model_defs.layers.linear import LinearFactory
from kiln.model_defs.layers.mlp import GatedMLP
from kiln.model_defs.layers.norm import RMSNorm
from kiln.model_defs.layers.parallel import VocabParallelEmbedding
from kiln.model_defs.layers.rotary import RotaryTables
from kiln.model_defs.registry import refuse

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
for _arch in ARCHITECTURES:  # a head is no model of its own: it drafts beside its target
    refuse(_arch, "an EAGLE-3 head drafts for one target engine: build it with `kiln build --checkpoint HEAD_DIR "
                  "--output HEAD_ENGINE --speculative-target TARGET_ENGINE` and pass it to the target with "
                  "--speculative-mode eagle3 --speculative-model HEAD_ENGINE")


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """The head's decoder layer as a ModelConfig (hidden size, heads, rope, eps), the target's vocabulary and
    hidden size it was trained for, its draft vocabulary and the target layers it reads (None: the default)."""

    layer: ModelConfig
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None
    norm_before_residual: bool = False  # the residual stream starts at hidden_norm(features), not the features

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input residual streams the head reads, in `fc`'s order."""
        return self.aux_layers or (2, target_layers // 2, target_layers - 3)


def is_head_config(raw: dict[str, Any]) -> bool:
    """Whether a config.json (or a head engine's model_config) names an EAGLE-3 head's architecture."""
    return (raw.get("architectures") or ["?"])[0] in ARCHITECTURES


def parse_head_config(raw: dict[str, Any], where: str) -> Eagle3HeadConfig:
    """A head's config.json as read (`where` names it in errors: the flag and directory); EngineError names the
    field at fault."""
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise EngineError(f"{where}: architectures {arch!r} is not an EAGLE-3 head ({' or '.join(ARCHITECTURES)})")
    if raw.get("num_hidden_layers", 1) != 1:
        raise EngineError(f"{where}: num_hidden_layers={raw['num_hidden_layers']}; an EAGLE-3 head has one "
                          f"decoder layer")
    try:
        layer = parse_decoder_config({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1},
                                     qkv_bias=bool(raw.get("attention_bias", False)),
                                     o_bias=bool(raw.get("attention_bias", False)), layer_sliding_windows=(0,))
    except ModelConfigError as e:
        raise EngineError(f"{where}: {e}") from None
    eagle = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3HeadConfig(layer, int(raw["vocab_size"]), int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                            int(raw.get("target_hidden_size") or layer.hidden_size),
                            tuple(int(i) for i in aux) if aux else None, bool(raw.get("norm_before_residual")))


def check_head(head: str, config: Eagle3HeadConfig, target_hidden_size: int, target_vocab_size: int,
               target: str = "the target") -> None:
    """Refuses a head trained for another target: its hidden size or vocabulary, naming both (`head` and
    `target` name them: a directory, or "the target")."""
    if config.target_hidden_size != target_hidden_size:
        raise EngineError(f"EAGLE-3 head {head} reads features of hidden size {config.target_hidden_size} but "
                          f"{target}'s hidden size is {target_hidden_size}: the head belongs to another model")
    if config.vocab_size != target_vocab_size:
        raise EngineError(f"EAGLE-3 head {head} has a vocabulary of {config.vocab_size} tokens but {target} has "
                          f"{target_vocab_size}: a head must share the target's tokenizer and vocabulary")


class Eagle3Head(nn.Module):
    """forward(token ids [T], features [T, 3H'] from the target or [T, H] from its own last step, ctx) ->
    (normed [T, H], prenorm [T, H]); `target_logits(normed)` -> [N, V] float32 over the target vocabulary."""

    def __init__(self, config: Eagle3HeadConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config.layer
        h, eps = c.hidden_size, c.rms_norm_eps
        linears = LinearFactory(dtype=dtype)
        self.config = config
        self.fc = linears.replicated("fc", 3 * config.target_hidden_size, h)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, dtype, None, None)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.hidden_norm = RMSNorm(h, eps, dtype)
        self.self_attn = Attention(c, 0, linears, "midlayer.self_attn")
        # Its attention reads the embedding and the features side by side: [T, 2H] in.
        self.self_attn.qkv_proj = linears.attention_qkv("midlayer.self_attn.qkv_proj", 2 * h, c.num_heads,
                                                        c.num_kv_heads, c.head_dim, c.qkv_bias)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.mlp = GatedMLP(c, 0, linears, "midlayer.mlp")
        self.norm = RMSNorm(h, eps, dtype)
        self.lm_head = linears.replicated("lm_head", h, config.draft_vocab_size)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size))  # [Dv] int64 target ids
        self.rotary: RotaryTables | None = None

    def setup_rotary(self, max_positions: int, device: torch.device) -> None:
        c = self.config.layer
        self.rotary = RotaryTables(c.rope, c.head_dim, c.max_position_embeddings, max_positions, device)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if features.shape[-1] != self.config.layer.hidden_size:
            features = self.fc(features)  # the target's three layers fused: [T, 3H'] -> [T, H]
        cos, sin = self.rotary.lookup(ctx.positions, ctx.rope_lengths, ctx.max_rope_length)  # [T, D/2] each
        embeds = self.input_layernorm(self.embed_tokens(input_ids))  # [T, H]
        normed = self.hidden_norm(features)
        # The residual stream starts at the features, before their norm (after it for norm_before_residual heads).
        residual = normed if self.config.norm_before_residual else features
        x = torch.cat([embeds, normed], dim=-1)  # [T, 2H]
        x = self.self_attn(x, ctx, cos, sin)  # [T, H]
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.norm.add_and_norm(self.mlp(x), residual)  # (normed, prenorm): [T, H] each

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed: [N, H] -> [N, V] float32: the draft vocabulary's logits at their target ids, -inf elsewhere."""
        draft = self.lm_head(normed).float()  # [N, Dv]
        out = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.draft_to_target] = draft
        return out


def published_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors by their published names (a `model.` prefix dropped, `layers.0.` read as `midlayer.`)."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        out[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = tensor
    return out


def head_state(head: str, config: Eagle3HeadConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's state (q/k/v and gate/up fused, `draft_to_target` [Dv] int64 from `d2t`; `embed_tokens.weight`
    only when the head has its own) from the published layout's tensors, as they are stored, each checked
    against the shape the config implies. An EngineError names a missing tensor or a mismatched shape."""
    tensors = published_names(tensors)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise EngineError(f"EAGLE-3 head {head} has no tensor {name!r} (has {sorted(tensors)})")
        return tensors[name]

    a, m = "midlayer.self_attn.", "midlayer.mlp."
    state = {
        "fc.weight": take("fc.weight"),
        "input_layernorm.weight": take("midlayer.input_layernorm.weight"),
        "hidden_norm.weight": take("midlayer.hidden_norm.weight"),
        "self_attn.qkv_proj.weight": torch.cat([take(a + f"{p}_proj.weight") for p in "qkv"]),
        "self_attn.o_proj.weight": take(a + "o_proj.weight"),
        "post_attention_layernorm.weight": take("midlayer.post_attention_layernorm.weight"),
        "mlp.gate_up_proj.weight": torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
        "mlp.down_proj.weight": take(m + "down_proj.weight"),
        "norm.weight": take("norm.weight"),
        "lm_head.weight": take("lm_head.weight"),
    }
    if config.layer.qkv_bias:
        state["self_attn.qkv_proj.bias"] = torch.cat([take(a + f"{p}_proj.bias") for p in "qkv"])
    if config.layer.o_bias:
        state["self_attn.o_proj.bias"] = take(a + "o_proj.bias")
    if "embed_tokens.weight" in tensors:
        state["embed_tokens.weight"] = tensors["embed_tokens.weight"]
    d2t = tensors.get("d2t")
    offsets = torch.zeros(config.draft_vocab_size, dtype=torch.int64) if d2t is None else d2t.to(torch.int64)
    ids = torch.arange(config.draft_vocab_size) + offsets  # [Dv] target ids
    if ids.shape != (config.draft_vocab_size,) or not bool(((ids >= 0) & (ids < config.vocab_size)).all()):
        raise EngineError(f"EAGLE-3 head {head}: d2t must map its {config.draft_vocab_size} draft ids into the "
                          f"target vocabulary of {config.vocab_size} tokens")
    state["draft_to_target"] = ids
    check_state(head, config, state)
    return state


def check_state(head: str, config: Eagle3HeadConfig, state: dict[str, torch.Tensor]) -> None:
    """Every tensor of `state` (the module's names; `embed_tokens.weight` optional) has the shape the config
    implies, and none is missing; an EngineError names the first that does not."""
    with torch.device("meta"):
        expected = Eagle3Head(config, torch.float32).state_dict()
    for name, shape in ((n, tuple(t.shape)) for n, t in expected.items()):
        if name not in state:
            if name == "embed_tokens.weight":
                continue
            raise EngineError(f"EAGLE-3 head {head} has no tensor {name!r}")
        if tuple(state[name].shape) != shape:
            raise EngineError(f"EAGLE-3 head {head}: {name} has shape {tuple(state[name].shape)}, expected {shape} "
                              f"from its config")


def head_module(config: Eagle3HeadConfig, state: dict[str, torch.Tensor],
                target_embedding: torch.Tensor) -> Eagle3Head:
    """The head with `state` (checked by `check_state`) on the target embedding's device and dtype;
    `target_embedding` [V, H] is shared when the state has no embedding of its own."""
    dtype, device = target_embedding.dtype, target_embedding.device
    state = {k: v.to(device=device, dtype=torch.int64 if k == "draft_to_target" else dtype)
             for k, v in state.items()}
    state.setdefault("embed_tokens.weight", target_embedding)
    with torch.device("meta"):
        head = Eagle3Head(config, dtype)
    head.load_state_dict(state, assign=True, strict=True)
    return head.eval()

"""An EAGLE-3 head read from the published layout (config.json + safetensors or .bin), as a torch module.

The layout is the one published for Llama-3.1-8B-Instruct (`LlamaForCausalLMEagle3`): `fc` [H, 3H'] fuses the
target's residual streams at three layers (H' the target's hidden size), one decoder layer `midlayer.*` whose
attention reads [input_layernorm(embedding); hidden_norm(features)] (2H wide), `norm`, an `lm_head` over a draft
vocabulary of `draft_vocab_size` tokens, and `d2t` (draft id -> target id - draft id) / `t2d` (which target ids
the draft vocabulary holds). The embedding is the head's own `embed_tokens` when it has one, else the target's.
A head whose config names `eagle_aux_hidden_state_layer_ids` reads those layers; else (2, L // 2, L - 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kiln.checkpoints.reader import CheckpointError, CheckpointReader
from kiln.engine_format import EngineError
from kiln.model_defs import ModelConfig, ModelConfigError
from kiln.model_defs.config import parse_decoder_config
from kiln.model_defs.layers.attention import Attention
from kiln.model_defs.layers.context import ForwardContext
from kiln.model_defs.layers.linear import LinearFactory
from kiln.model_defs.layers.mlp import GatedMLP
from kiln.model_defs.layers.norm import RMSNorm
from kiln.model_defs.layers.parallel import VocabParallelEmbedding
from kiln.model_defs.layers.rotary import RotaryTables

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


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


def read_head_config(head_dir: Path) -> Eagle3HeadConfig:
    """The head's config.json; an EngineError names the directory and the field at fault."""
    path = head_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"--speculative-model {head_dir}: no readable EAGLE-3 config.json ({e})") from None
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise EngineError(f"--speculative-model {head_dir}: architectures {arch!r} is not an EAGLE-3 head "
                          f"({' or '.join(ARCHITECTURES)})")
    if raw.get("num_hidden_layers", 1) != 1:
        raise EngineError(f"--speculative-model {head_dir}: num_hidden_layers={raw['num_hidden_layers']}; an "
                          f"EAGLE-3 head has one decoder layer")
    try:
        layer = parse_decoder_config({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1},
                                     qkv_bias=bool(raw.get("attention_bias", False)),
                                     o_bias=bool(raw.get("attention_bias", False)), layer_sliding_windows=(0,))
    except ModelConfigError as e:
        raise EngineError(f"--speculative-model {head_dir}: {e}") from None
    eagle = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3HeadConfig(layer, int(raw["vocab_size"]), int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                            int(raw.get("target_hidden_size") or layer.hidden_size),
                            tuple(int(i) for i in aux) if aux else None, bool(raw.get("norm_before_residual")))


def check_head(head_dir: Path, config: Eagle3HeadConfig, target: ModelConfig) -> None:
    """Refuses a head trained for another target: its hidden size or vocabulary, naming both."""
    if config.target_hidden_size != target.hidden_size:
        raise EngineError(f"EAGLE-3 head {head_dir} reads features of hidden size {config.target_hidden_size} but "
                          f"the target's hidden size is {target.hidden_size}: the head belongs to another model")
    if config.vocab_size != target.vocab_size:
        raise EngineError(f"EAGLE-3 head {head_dir} has a vocabulary of {config.vocab_size} tokens but the target "
                          f"has {target.vocab_size}: a head must share the target's tokenizer and vocabulary")


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


def _checkpoint_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head, by its published name (a `model.` prefix and `layers.0.` read as `midlayer.`)."""
    try:
        reader = CheckpointReader(head_dir)
        try:
            tensors = {name: reader.get(name) for name in reader.names()}
        finally:
            reader.close()
    except CheckpointError as e:
        raise EngineError(f"--speculative-model {head_dir}: {e}") from None
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        out[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = tensor
    return out


def load_head(head_dir: str | Path, target: ModelConfig, target_embedding: torch.Tensor) -> Eagle3Head:
    """The head in `head_dir` on the target embedding's device and dtype; `target_embedding` [V, H] is shared
    when the head has no embedding of its own. An EngineError names a missing tensor, a mismatched shape or a
    head trained for another target."""
    head_dir = Path(head_dir)
    config = read_head_config(head_dir)
    check_head(head_dir, config, target)
    tensors = _checkpoint_tensors(head_dir)
    dtype, device = target_embedding.dtype, target_embedding.device

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise EngineError(f"EAGLE-3 head {head_dir} has no tensor {name!r} (has {sorted(tensors)})")
        return tensors[name]

    a = "midlayer.self_attn."
    m = "midlayer.mlp."
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
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    own = tensors.get("embed_tokens.weight")
    state["embed_tokens.weight"] = target_embedding if own is None else own.to(device=device, dtype=dtype)
    d2t = tensors.get("d2t")
    offsets = torch.zeros(config.draft_vocab_size, dtype=torch.int64) if d2t is None else d2t.to(torch.int64)
    ids = torch.arange(config.draft_vocab_size) + offsets  # [Dv] target ids
    if ids.shape != (config.draft_vocab_size,) or not bool(((ids >= 0) & (ids < config.vocab_size)).all()):
        raise EngineError(f"EAGLE-3 head {head_dir}: d2t must map its {config.draft_vocab_size} draft ids into the "
                          f"target vocabulary of {config.vocab_size} tokens")
    state["draft_to_target"] = ids.to(device)
    with torch.device("meta"):
        head = Eagle3Head(config, dtype)
    expected = head.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise EngineError(f"EAGLE-3 head {head_dir}: {name} has shape {tuple(tensor.shape)}, expected "
                              f"{tuple(expected[name].shape)} from its config.json")
    head.load_state_dict(state, assign=True, strict=True)
    return head.eval()

"""The normalized model configuration: what kiln needs of a Hugging Face config.json, typed and checked.

Model files turn a raw config.json dict into a ModelConfig (see `parse_decoder_config`); the engine stores
`ModelConfig.to_dict()` in engine.json and the runtime reads it back with `ModelConfig.from_dict`, so the
runtime never needs transformers' config classes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from .config_limits import (
    ModelConfigError,
    check_count,
    check_positive_finite,
    check_token_id,
    is_count,
)
from .mla_config import GroupedRouting, MLAConfig, as_config
from .rope_params import (
    check_factor_list,
    check_partial_rotary_factor,
    check_rope_dims,
    longrope_fields,
)

QK_NORM_SCOPES = ("head", "projection")
# transformers' activation names that are torch's GELU: exact (erf) and the tanh approximation.
GELU_ACTS = ("gelu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `factor` applies to the scaled types, the llama3 and yarn fields only to
    their rope_type (named as in transformers' rope_parameters; layers/rotary.py computes the tables)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn: the band of dimensions between beta_fast and beta_slow rotations is ramped from extrapolated to
    # interpolated frequencies; cos/sin are multiplied by attention_factor, which None infers from factor
    # (and mscale / mscale_all_dim when both are non-zero) as transformers does.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    # longrope (rope_params.py): per rotated pair of dimensions, the frequency divisors up to
    # original_max_position_embeddings tokens (short) and past it (long); attention_factor as for yarn.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # The share of each head that rotates (Phi-4-mini: 0.75); the rest passes through.
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        # NaN passes a `<= 0` test, and a NaN or infinite theta makes every rotation NaN: finite is checked.
        check_positive_finite("rope_theta", self.theta)
        check_positive_finite("rope_scaling factor", self.factor)
        if self.rope_type == "llama3":
            check_positive_finite("rope_scaling low_freq_factor", self.low_freq_factor)
            check_positive_finite("rope_scaling high_freq_factor", self.high_freq_factor)
            if self.high_freq_factor <= self.low_freq_factor:  # llama3 smoothing divides by their difference
                raise ModelConfigError(f"rope_scaling high_freq_factor={self.high_freq_factor} must exceed "
                                       f"low_freq_factor={self.low_freq_factor}")
        check_count("rope_scaling original_max_position_embeddings", self.original_max_position_embeddings,
                    "max_position_embeddings", minimum=1 if self.rope_type in ("yarn", "longrope") else 0)
        if self.rope_type == "yarn":
            self._check_yarn()
        check_partial_rotary_factor(self.partial_rotary_factor)
        if self.rope_type == "longrope":  # engine.json gives lists: kept as tuples (frozen, hashable)
            object.__setattr__(self, "short_factor", check_factor_list("short_factor", self.short_factor))
            object.__setattr__(self, "long_factor", check_factor_list("long_factor", self.long_factor))
            if self.attention_factor is not None:
                check_positive_finite("rope_scaling attention_factor", self.attention_factor)

    def _check_yarn(self) -> None:
        # The correction range takes log(original_max_position_embeddings / (beta * 2 pi)): betas must be > 0.
        check_positive_finite("rope_scaling beta_fast", self.beta_fast)
        check_positive_finite("rope_scaling beta_slow", self.beta_slow)
        if self.beta_fast < self.beta_slow:  # transformers: "beta_fast must be greater than beta_slow"
            raise ModelConfigError(f"rope_scaling beta_fast={self.beta_fast} must be >= beta_slow={self.beta_slow}")
        for name in ("mscale", "mscale_all_dim"):  # 0 means unset, as in transformers
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ModelConfigError(f"rope_scaling {name}={value!r:.80} must be a finite number >= 0")
        if self.attention_factor is not None:
            check_positive_finite("rope_scaling attention_factor", self.attention_factor)
        if not isinstance(self.truncate, bool):
            raise ModelConfigError(f"rope_scaling truncate={self.truncate!r:.80} must be true or false")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: `num_experts` SwiGLU experts of `intermediate_size`, `top_k` per token
    (softmax over the router's logits, then top-k, divided by their sum when `renormalize`), an optional
    shared expert (Qwen2-MoE: `shared_expert_intermediate_size` > 0, scaled by a sigmoid gate), and per layer
    whether it is sparse (`sparse_layers`; the other layers keep the dense MLP of the model's intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0
    # DeepSeek-MoE's grouped router (mla_config.py); None: softmax, top-k, divided by their sum when `renormalize`.
    routing: GroupedRouting | None = None
    # GPT-OSS: router and expert biases, the clamped SwiGLU (swiglu_limit > 0: plugins/moe.py's expert_activation)
    bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # The checkpoint's expert weights are MXFP4 (plugins/mxfp4.py): kept so in the engine (kiln.quant.mxfp4), or
    # dequantized at build to the engine dtype (--dequantize)
    mxfp4_experts: bool = False

    def __post_init__(self) -> None:
        for f in ("num_experts", "top_k", "intermediate_size"):
            check_count(f"MoE config field {f}", getattr(self, f), f if f != "top_k" else "num_experts")
        check_count("MoE config field shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                    "shared_expert_intermediate_size", minimum=0)
        if self.top_k > self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts")
        for f in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, f)
            if value != 0:  # 0: plain SwiGLU
                check_positive_finite(f"MoE config field {f}", value)
        object.__setattr__(self, "sparse_layers", tuple(bool(s) for s in self.sparse_layers))
        object.__setattr__(self, "routing", as_config(GroupedRouting, self.routing, "moe.routing"))
        if self.routing is not None:
            self.routing.check_experts(self.num_experts, self.top_k)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # every norm's epsilon (Starcoder2's LayerNorms: its norm_epsilon)
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # What q_norm / k_norm normalize: "head" (each head alone, Qwen3) or "projection" (all of q, all of k: OLMo 2).
    qk_norm_scope: str = "head"
    # The MLP's activation: "silu" (the gated SwiGLU MLP); the plain MLP (Starcoder2) takes the GELUs of GELU_ACTS.
    hidden_act: str = "silu"
    # Per layer: 0 = full causal attention, W > 0 = each token sees the last W tokens (itself included).
    layer_sliding_windows: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # From generation_config.json when the checkpoint has one, else config.json.
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    # Granite's scalars: embeddings times embedding_multiplier, each sublayer's output times residual_multiplier
    # before its residual add, attention scores times attention_multiplier (None: 1/sqrt(head_dim)), logits
    # divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Per layer: whether rotary applies (SmolLM3's no_rope_layers: 0 = NoPE layer); () means every layer.
    layer_rope: tuple[bool, ...] = ()
    # Gemma 2's tanh soft-capping (0 = off): attention scores s -> cap * tanh(s / cap) before the mask and
    # softmax, and likewise the final logits.
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # The rope of the sliding-window layers where it differs from `rope` (Gemma 3's local layers:
    # rope_local_base_freq, unscaled); None: every layer rotates by `rope`.
    sliding_rope: RopeConfig | None = None
    # DeepSeek's multi-head latent attention (mla_config.py): head_dim is then the rope part
    # (qk_rope_head_dim) and the KV cache holds one latent per token and layer; None: ordinary attention.
    mla: MLAConfig | None = None
    # GPT-OSS: a learned logit per query head (`self_attn.sinks`) joins the softmax's denominator
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        # Bounds first (config_limits.py): nothing below, nor the network, is sized by an absurd count.
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings"):
            check_count(f"config field {f}", getattr(self, f), f)
        check_positive_finite("rms_norm_eps", self.rms_norm_eps)
        for i, eos in enumerate(self.eos_token_ids):
            check_token_id(f"eos_token_id[{i}]" if len(self.eos_token_ids) > 1 else "eos_token_id", eos,
                           self.vocab_size)
        if self.bos_token_id is not None:
            check_token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        check_rope_dims(self.rope, self.head_dim)
        object.__setattr__(self, "mla", as_config(MLAConfig, self.mla, "mla"))
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (0,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ModelConfigError(
                f"{len(self.layer_sliding_windows)} layer attention types for {self.num_layers} layers"
            )
        for i, window in enumerate(self.layer_sliding_windows):
            if not is_count(window) or window < 0:
                raise ModelConfigError(f"layer_sliding_windows[{i}]={window!r} must be an integer >= 0 (0: none)")
        if not self.layer_rope:
            object.__setattr__(self, "layer_rope", (True,) * self.num_layers)
        if len(self.layer_rope) != self.num_layers:
            raise ModelConfigError(f"{len(self.layer_rope)} per-layer rope flags (no_rope_layers) for "
                                   f"{self.num_layers} layers")
        object.__setattr__(self, "layer_rope", tuple(bool(r) for r in self.layer_rope))
        for f in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            check_positive_finite(f, getattr(self, f))
        if self.attention_multiplier is not None:
            check_positive_finite("attention_multiplier", self.attention_multiplier)
        for f in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, f)
            if value != 0:  # 0: off
                check_positive_finite(f, value)
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ModelConfigError(f"qk_norm_scope={self.qk_norm_scope!r}; kiln has {', '.join(QK_NORM_SCOPES)}")
        if self.hidden_act not in ("silu", *GELU_ACTS):
            raise ModelConfigError(f"hidden_act={self.hidden_act!r} is not supported; supported: silu, "
                                   f"{', '.join(GELU_ACTS)}")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ModelConfigError(f"{len(self.moe.sparse_layers)} MoE layer flags for {self.num_layers} layers")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_sliding_windows"] = list(self.layer_sliding_windows)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_rope"] = list(self.layer_rope)
        if self.moe is not None:
            d["moe"]["sparse_layers"] = list(self.moe.sparse_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ModelConfigError(f"unknown model_config fields {sorted(unknown)}")
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        if d.get("sliding_rope") is not None:
            d["sliding_rope"] = RopeConfig(**d["sliding_rope"])
        d["layer_sliding_windows"] = tuple(d.get("layer_sliding_windows", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_rope"] = tuple(d.get("layer_rope", ()))
        if d.get("moe") is not None:
            d["moe"] = MoEConfig(**d["moe"])
        return cls(**d)


def token_id_list(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (int, list of ints or None) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def required(raw: dict[str, Any], key: str, default: Any = ...) -> Any:
    """raw[key], or ModelConfigError naming the missing field (or `default` when one is given)."""
    if key in raw and raw[key] is not None:
        return raw[key]
    if default is ...:
        raise ModelConfigError(f"config.json lacks the required field {key!r}")
    return default


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Reads rope settings from either layout: transformers 5 (`rope_parameters`) or older
    (`rope_theta` + `rope_scaling`)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "longrope":
        return RopeConfig(**longrope_fields(params, raw, theta))
    if "factor" not in params:
        raise ModelConfigError(f"rope scaling {rope_type!r} needs a 'factor'")
    # transformers gives a top-level original_max_position_embeddings (Phi-3's layout) priority over the rope
    # dict's for the types that use it, and falls back to max_position_embeddings.
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 0))
    if rope_type in ("llama3", "yarn") and raw.get("original_max_position_embeddings") is not None:
        original = raw["original_max_position_embeddings"]
    if rope_type == "yarn":
        return _parse_yarn(params, theta, original, raw.get("max_position_embeddings"))
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def _rope_number(params: dict[str, Any], key: str, default: float | None) -> float | None:
    """params[key] as a float, `default` when absent or null; ModelConfigError naming it when not a number."""
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"rope_scaling {key}={value!r:.80} must be a number")
    return float(value)


def _parse_yarn(params: dict[str, Any], theta: float, original: Any, max_positions: Any) -> RopeConfig:
    # Read as transformers' _compute_yarn_parameters reads them: a null factor is the context extension
    # max_position_embeddings / original_max_position_embeddings; a zero or null beta is its default.
    original = check_count("rope_scaling original_max_position_embeddings", original, "max_position_embeddings")
    factor = _rope_number(params, "factor", None)
    if factor is None:
        factor = check_count("max_position_embeddings", max_positions) / original
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=_rope_number(params, "beta_fast", None) or 32.0,
        beta_slow=_rope_number(params, "beta_slow", None) or 1.0,
        mscale=_rope_number(params, "mscale", 0.0),
        mscale_all_dim=_rope_number(params, "mscale_all_dim", 0.0),
        attention_factor=_rope_number(params, "attention_factor", None),
        truncate=params.get("truncate", True),
    )


def parse_decoder_config(
    raw: dict[str, Any],
    *,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool = False,
    layer_sliding_windows: tuple[int, ...] = (),
    hidden_acts: tuple[str, ...] = ("silu",),
) -> ModelConfig:
    """The fields every Llama-like decoder shares; the model file decides biases, norms, windows and which
    activations its MLP takes (`hidden_acts`, the first the default)."""
    act = raw.get("hidden_act", hidden_acts[0])
    if act not in hidden_acts:
        mlp = "SwiGLU MLP" if hidden_acts == ("silu",) else "its MLP"
        raise ModelConfigError(f"hidden_act={act!r} is not supported for {raw['architectures'][0]}; supported: "
                               f"{', '.join(hidden_acts)} ({mlp})")
    hidden = required(raw, "hidden_size")
    # Checked before dividing by it (model_def_for_hf_config checks every count already; not every caller uses it).
    heads = check_count("num_attention_heads", required(raw, "num_attention_heads"), "num_heads")
    if raw.get("head_dim") is None and hidden % heads:  # transformers' default head_dim is hidden // heads
        raise ModelConfigError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and no "
                               f"head_dim is given)")
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    return ModelConfig(
        architecture=raw["architectures"][0],
        vocab_size=required(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=required(raw, "intermediate_size"),
        num_layers=required(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=required(raw, "num_key_value_heads", heads),
        head_dim=required(raw, "head_dim", hidden // heads),
        rms_norm_eps=float(required(raw, "rms_norm_eps", 1e-6)),
        max_position_embeddings=required(raw, "max_position_embeddings", 2048),
        rope=parse_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
        hidden_act=act,
        layer_sliding_windows=layer_sliding_windows,
        torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        eos_token_ids=token_id_list(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )

"""DeepSeek's config pieces: multi-head latent attention (MLA) and DeepSeek-MoE's grouped expert routing,
typed and checked, plus the paged KV cache's per-layer layout (which MLA changes).

`ModelConfig.mla` and `MoEConfig.routing` hold them (None for every other family); engine.json stores them as
nested dicts, turned back into these classes by the owners' `__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .config_limits import ModelConfigError, check_count, check_positive_finite

SCORING_FUNCTIONS = ("softmax", "sigmoid")
# greedy / group_limited_greedy: DeepSeek-V2 (softmax scores); noaux_tc: DeepSeek-V3 (sigmoid scores plus the
# e_score_correction_bias for the choice, groups ranked by their two best experts).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Per token the cache holds the compressed latent:
    kv_lora_rank values (kv_a_layernorm's output) and qk_rope_head_dim values of the rotated shared key;
    kv_b_proj up-projects the latent to each head's k_nope [qk_nope_head_dim] and v [v_head_dim].
    q_lora_rank 0: queries come from q_proj directly (V2-Lite); else q_a_proj -> q_a_layernorm -> q_b_proj.
    rope_interleave: the checkpoint's rope rows come as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
    layout; transformers' V2 always, V3 when rope_interleave); the engine's are reordered to halves at build.
    fp8_block_size: the checkpoint's FP8 weight_block_size [rows, columns] when it is block-scaled FP8 (DeepSeek-V3's
    release; None: a float checkpoint). Its linears stay FP8 in the engine; kv_b_proj (absorbed, read as a float
    matrix) and the routed experts (the fused MoE operator takes float experts) are dequantized at build."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    fp8_block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.fp8_block_size is not None:  # engine.json stores it as a list
            block = self.fp8_block_size
            if (not isinstance(block, list | tuple) or len(block) != 2
                    or any(type(b) is not int or b <= 0 for b in block)):
                raise ModelConfigError(f"fp8_block_size={block!r:.80} must be two positive integers [rows, columns]")
            object.__setattr__(self, "fp8_block_size", tuple(block))
        check_count("q_lora_rank", self.q_lora_rank, "hidden_size", minimum=0)
        check_count("kv_lora_rank", self.kv_lora_rank, "hidden_size")
        for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_count(f, getattr(self, f), "head_dim")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings")

    @property
    def latent_dim(self) -> int:
        """Cached values per token and layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-MoE's router (transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter): `scoring` of the
    router logits (float32), the top-k choice (`topk_method`, within the `topk_group` best of `n_group` expert
    groups for the grouped methods), weights normalized to sum 1 when `norm_topk_prob` and multiplied by
    `routed_scaling_factor` (V2: one or the other, as DeepSeek's code does). noaux_tc adds the router's
    `e_score_correction_bias` to the scores for the choice only."""

    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCTIONS:
            raise ModelConfigError(f"scoring_func={self.scoring!r} is not supported; supported: "
                                   f"{', '.join(SCORING_FUNCTIONS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ModelConfigError(f"topk_method={self.topk_method!r} is not supported; supported: "
                                   f"{', '.join(TOPK_METHODS)}")
        check_count("n_group", self.n_group, "num_experts")
        check_count("topk_group", self.topk_group, "num_experts")
        if self.topk_group > self.n_group:
            raise ModelConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        check_positive_finite("routed_scaling_factor", self.routed_scaling_factor)
        if not isinstance(self.norm_topk_prob, bool):
            raise ModelConfigError(f"norm_topk_prob={self.norm_topk_prob!r:.80} must be true or false")

    @property
    def correction_bias(self) -> bool:
        """Whether the router has an e_score_correction_bias [E] (V3's noaux_tc)."""
        return self.topk_method == "noaux_tc"

    def check_experts(self, num_experts: int, top_k: int) -> None:
        """ModelConfigError unless the experts split into n_group groups holding top_k experts in the chosen ones."""
        if num_experts % self.n_group:
            raise ModelConfigError(f"n_routed_experts={num_experts} is not a multiple of n_group={self.n_group}")
        if self.topk_method != "greedy" and self.topk_group * (num_experts // self.n_group) < top_k:
            raise ModelConfigError(f"num_experts_per_tok={top_k} exceeds the {self.topk_group} chosen groups' "
                                   f"{self.topk_group * (num_experts // self.n_group)} experts")
        if self.topk_method == "noaux_tc" and num_experts // self.n_group < 2:
            raise ModelConfigError("noaux_tc ranks a group by its two best experts: n_group must leave at least 2 "
                                   f"experts a group (n_routed_experts={num_experts}, n_group={self.n_group})")


def as_config(cls: type, value: Any, field: str) -> Any:
    """A nested config from engine.json (a dict) as `cls`; the instance or None as is."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ModelConfigError(f"model_config field {field} must be an object, got {value!r:.80}")
    try:
        return cls(**value)
    except TypeError as e:
        raise ModelConfigError(f"model_config field {field}: {e}") from None


def kv_cache_layout(config: Any) -> tuple[int, int, int]:
    """(planes, heads, dim) of one layer's paged cache for one tensor-parallel rank's `config`
    (kv_cache.rank_cache_config): (2, Hk, head_dim) for keys and values; (1, 1, kv_lora_rank + rope dim) for
    MLA, whose one "head" of compressed latents is both (replicated over ranks)."""
    mla: MLAConfig | None = getattr(config, "mla", None)
    if mla is not None:
        return 1, 1, mla.latent_dim
    return 2, config.num_kv_heads, config.head_dim


def kv_values_per_token(config: Any) -> int:
    """Cached values of one token over all layers (times the element size: the cache's bytes per token)."""
    return config.num_layers * math.prod(kv_cache_layout(config))

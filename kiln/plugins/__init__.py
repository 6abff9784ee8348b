"""Custom operators ("plugins"), each a torch.library op with a PyTorch reference (CPU, the tests' oracle)
and, where registered, a GPU kernel. Call the wrappers below: they check arguments before launching."""

from .activation import silu_and_mul
from .attention import paged_attention
from .fp8_block_linear import fp8_block_linear
from .kv_cache import write_kv_cache
from .lora import lora_add
from .mla_attention import mla_attention
from .moe import fused_moe
from .mxfp4_moe import fused_moe_mxfp4
from .norm import fused_add_rms_norm, rms_norm
from .norm_quant import fused_add_rms_norm_quant, rms_norm_quant, silu_and_mul_quant
from .quant_linear import scaled_linear, scaled_linear_quantized, weight_only_linear
from .rotary import rotary_embedding
from .rotary_kv import rotary_embedding_and_write_kv
from .weight_only_parts import weight_only_linear_parts

__all__ = ["fused_add_rms_norm", "paged_attention", "rms_norm", "rotary_embedding",
           "rotary_embedding_and_write_kv", "scaled_linear", "silu_and_mul", "weight_only_linear",
           "write_kv_cache", "fp8_block_linear", "fused_moe", "fused_add_rms_norm_quant", "rms_norm_quant",
           "silu_and_mul_quant", "scaled_linear_quantized", "weight_only_linear_parts", "lora_add", "mla_attention",
           "fused_moe_mxfp4"]

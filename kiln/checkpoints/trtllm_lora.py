"""TensorRT-LLM's LoRA request tensors -> a Hugging Face PEFT adapter directory that kiln reads like any other.

TensorRT-LLM's Triton backend takes an adapter with the request that first names its `lora_task_id`, as two
tensors (made by TensorRT-LLM's `hf_lora_convert.py`; the batch dimension is the caller's):
- `lora_config` INT32 [N, 3]: one row per adapted module and layer, `[module_id, layer_idx, adapter_size]`
  (newer TensorRT-LLM accepts a 4th column, `is_dora`; DoRA is refused here);
- `lora_weights` [N, L]: row i is module i's in-weight A [r, in] flattened, then its out-weight B [out, r]
  flattened (PEFT's lora_A / lora_B orientation), zero-padded to the longest row. The converter has already
  multiplied B by the scaling (lora_alpha / r, or / sqrt(r) with rsLoRA), so no alpha travels.

Module ids (TensorRT-LLM's LoraModule::ModuleType) and the Llama projection each adapts: attn_qkv 0 (q, k
and v with one shared A, B's rows [q | k | v]), attn_q 1, attn_k 2, attn_v 3, attn_dense 4 (o_proj),
mlp_h_to_4h 5 (gate_proj: TensorRT-LLM's `fc`, the activated branch), mlp_4h_to_h 6 (down_proj), mlp_gate 7
(up_proj: TensorRT-LLM's `gate`, the multiplied branch) -- hf_lora_convert.py's own mapping.

The directory written holds every module at the adapter's largest rank (smaller ones padded with zero rows of
A and columns of B, which add nothing) with lora_alpha = r, so PEFT's scaling is 1 and B keeps TensorRT-LLM's
folded scale. Every problem raises `TRTLLMLoRAError` naming the tensor, its row, the module, layer and value.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln.model_defs.config import ModelConfig

from .lora_adapter import LoRAError

# TensorRT-LLM's module ids (tensorrt_llm/lora_manager.py, LoraManager.LORA_MODULE_IDS).
MODULE_IDS = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5,
              "mlp_4h_to_h": 6, "mlp_gate": 7, "cross_attn_qkv": 8, "cross_attn_q": 9, "cross_attn_k": 10,
              "cross_attn_v": 11, "cross_attn_dense": 12, "moe_h_to_4h": 13, "moe_4h_to_h": 14, "moe_gate": 15,
              "moe_router": 16, "mlp_router": 17, "mlp_gate_up": 18}
MODULE_NAMES = {v: k for k, v in MODULE_IDS.items()}
# module id -> the Hugging Face projections it adapts (attn_qkv: three, sharing A).
HF_MODULES = {0: ("q_proj", "k_proj", "v_proj"), 1: ("q_proj",), 2: ("k_proj",), 3: ("v_proj",), 4: ("o_proj",),
              5: ("gate_proj",), 6: ("down_proj",), 7: ("up_proj",)}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
WEIGHTS, CONFIG = "lora_weights", "lora_config"


class TRTLLMLoRAError(LoRAError):
    """An adapter in TensorRT-LLM's tensors that kiln cannot serve; `tensor` is the input to blame."""

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


def _shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module -> (out, in) of its base weight."""
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def check_shapes(weights: np.ndarray, config: np.ndarray) -> None:
    """The tensors' shapes alone (no model needed): weights [N, L], config [N, 3 or 4], the same N >= 1."""
    if config.ndim != 2 or config.shape[1] not in (3, 4) or config.shape[0] < 1:
        raise TRTLLMLoRAError(f"input '{CONFIG}' has shape {list(config.shape)} per request; expected [N, 3] "
                              "(rows of [module_id, layer_idx, adapter_size]), N >= 1", CONFIG)
    if weights.ndim != 2 or weights.shape[0] != config.shape[0]:
        raise TRTLLMLoRAError(f"input '{WEIGHTS}' has shape {list(weights.shape)} per request; expected "
                              f"[{config.shape[0]}, L]: one row per row of {CONFIG}", WEIGHTS)


def convert(weights: np.ndarray, config: np.ndarray, model_config: ModelConfig,
            max_lora_rank: int) -> dict[str, np.ndarray]:
    """TensorRT-LLM's tensors of one adapter -> PEFT's tensors (float32, every module at the largest rank),
    named `base_model.model.model.layers.N.{self_attn,mlp}.X.lora_{A,B}.weight`."""
    check_shapes(weights, config)
    shapes = _shapes(model_config)
    parts: dict[tuple[int, str], tuple[int, np.ndarray, np.ndarray]] = {}  # (layer, module) -> (row, A, B)
    for i, row in enumerate(config.tolist()):
        module_id, layer, rank = row[:3]
        where = f"input '{CONFIG}' row {i} ({row})"
        if len(row) == 4 and row[3] != 0:
            raise TRTLLMLoRAError(f"{where}: is_dora={row[3]}; DoRA adapters are not supported", CONFIG)
        if module_id not in HF_MODULES:
            name = MODULE_NAMES.get(module_id)
            known = ", ".join(f"{MODULE_NAMES[m]}={m}" for m in HF_MODULES)
            raise TRTLLMLoRAError(f"{where}: module_id {module_id}{f' ({name})' if name else ''} is not a module "
                                  f"kiln can adapt; supported: {known}", CONFIG)
        module_name = MODULE_NAMES[module_id]
        if not 0 <= layer < model_config.num_layers:
            raise TRTLLMLoRAError(f"{where}: layer_idx {layer} of {module_name} is out of range; the model has "
                                  f"{model_config.num_layers} layers (0..{model_config.num_layers - 1})", CONFIG)
        if not 0 < rank <= max_lora_rank:
            raise TRTLLMLoRAError(f"{where}: adapter_size {rank} of {module_name} layer {layer} must be in "
                                  f"[1, max_lora_rank={max_lora_rank}] (raise --max-lora-rank)", CONFIG)
        hf = HF_MODULES[module_id]
        in_size = shapes[hf[0]][1]
        outs = [shapes[m][0] for m in hf]
        need = rank * in_size + sum(outs) * rank
        if need > weights.shape[1]:
            raise TRTLLMLoRAError(f"input '{WEIGHTS}' row {i} has {weights.shape[1]} values; {module_name} of layer "
                                  f"{layer} at adapter_size {rank} needs {need} ({rank}x{in_size} in-weight, then "
                                  f"{sum(outs)}x{rank} out-weight)", WEIGHTS)
        values = weights[i, :need].astype(np.float32)
        if not np.isfinite(values).all():
            raise TRTLLMLoRAError(f"input '{WEIGHTS}' row {i} ({module_name} layer {layer}) holds values that "
                                  "are not finite", WEIGHTS)
        a = values[:rank * in_size].reshape(rank, in_size)
        b = values[rank * in_size:].reshape(sum(outs), rank)
        start = 0
        for module, out in zip(hf, outs):
            if (layer, module) in parts:
                first = parts[layer, module][0]
                raise TRTLLMLoRAError(f"{where}: {module_name} adapts {module} of layer {layer}, which row "
                                      f"{first} already adapts", CONFIG)
            parts[layer, module] = (i, a, b[start:start + out])
            start += out
    top = max(a.shape[0] for _, a, _ in parts.values())
    tensors = {}
    for (layer, module), (_, a, b) in sorted(parts.items()):
        key = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
        tensors[f"{key}.lora_A.weight"] = np.pad(a, ((0, top - a.shape[0]), (0, 0)))
        tensors[f"{key}.lora_B.weight"] = np.pad(b, ((0, 0), (0, top - b.shape[1])))
    return tensors


def write_peft_adapter(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    """`convert`'s tensors as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.numpy import save_file

    rank = max(t.shape[0] for name, t in tensors.items() if name.endswith("lora_A.weight"))
    modules = sorted({name.split(".")[-3] for name in tensors})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": modules, "bias": "none",
              "task_type": "CAUSAL_LM", "use_rslora": False,
              "kiln_source": "TensorRT-LLM lora_weights / lora_config (B holds the scaling)"}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))

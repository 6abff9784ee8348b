"""Reading Hugging Face PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) onto kiln's
layers (`lora_adapter.py` says how they are laid out).

PEFT saves one (lora_A, lora_B) pair per adapted module, named by the module's path in the transformers model:
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]).
The tensors, not `target_modules`, say which modules are adapted (PEFT already applied target_modules,
exclude_modules, layers_to_transform and layers_pattern when it made them); target_modules is still checked
so that an adapter naming modules kiln does not have (an embedding, the lm_head, anything else) is refused
by name rather than half served. `rank_pattern` and `alpha_pattern` are honoured with PEFT's own matching.
`fan_in_fan_out` only transposes GPT-2-style Conv1D base weights; LoRA factors are nn.Linear weights either
way, so it changes nothing here. `adapter_model.bin` is read with `torch.load(weights_only=True)`, which
unpickles tensors only, never code.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kiln.model_defs.config import ModelConfig
from kiln.model_defs.recipes import FUSED_MODULES

from .lora_adapter import LoRAAdapter, LoRAError, LoRALinear, LoRAPart

__all__ = ["LoRAAdapter", "LoRAError", "read_lora_adapter"]

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# HF module -> (kiln linear, its parent block); the parts of a fused linear in row order come from FUSED_MODULES.
_MODULES = {"q_proj": ("qkv_proj", "self_attn"), "k_proj": ("qkv_proj", "self_attn"),
            "v_proj": ("qkv_proj", "self_attn"), "o_proj": ("o_proj", "self_attn"),
            "gate_proj": ("gate_up_proj", "mlp"), "up_proj": ("gate_up_proj", "mlp"), "down_proj": ("down_proj", "mlp")}
_EMBEDDINGS = ("embed_tokens", "lm_head")
_PREFIX = "base_model.model."
_KEY = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Config keys that change what the factors mean or add tensors kiln would ignore: refused when set.
_UNSUPPORTED_KEYS = {
    "use_dora": "DoRA (weight-decomposed LoRA) needs the base weights' norms per step",
    "modules_to_save": "fully trained copies of modules (embeddings, lm_head) replace base weights",
    "trainable_token_indices": "trained embedding rows replace base weights",
    "lora_bias": "a bias on lora_B",
    "layer_replication": "replicated layers change the base model's depth",
    "target_parameters": "adapters on raw parameters (MoE experts)",
    "alora_invocation_tokens": "activated LoRA switches on mid-prompt",
    "use_qalora": "QA-LoRA pools the input",
}


def read_lora_adapter(path: str | Path, model_config: ModelConfig, *, max_lora_rank: int,
                      name: str | None = None) -> LoRAAdapter:
    """The PEFT LoRA adapter in directory `path`, checked against the base model `model_config`, mapped onto
    kiln's linears (scaling folded into B, float32). `name` defaults to the directory's name. Raises
    LoRAError naming the field, tensor or file, its value and the limit, for anything kiln cannot serve."""
    root = Path(path)
    config = _read_config(root)
    rank, alpha = _check_config(config, max_lora_rank, root)
    _check_targets(config.get("target_modules"), model_config, root)
    tensors = _read_tensors(root)
    modules = _group_modules(tensors, model_config, root)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    use_rslora = bool(config.get("use_rslora", False))
    shapes = _module_shapes(model_config)
    grouped: dict[str, dict[str, LoRAPart]] = {}
    for module_path, (a, b) in sorted(modules.items()):
        module = module_path.rsplit(".", 1)[1]
        r = _pattern_value(rank_pattern, module_path, rank, "rank_pattern", root)
        if not isinstance(r, int) or isinstance(r, bool) or not 0 < r <= max_lora_rank:
            raise LoRAError(f"{root / CONFIG_FILE}: rank r={r!r} for {module_path} must be an integer in "
                            f"[1, max_lora_rank={max_lora_rank}]")
        lora_alpha = _pattern_value(alpha_pattern, module_path, alpha, "alpha_pattern", root)
        out_size, in_size = shapes[module]
        for tensor, got, want in (("lora_A", a, (r, in_size)), ("lora_B", b, (out_size, r))):
            if tuple(got.shape) != want:
                raise LoRAError(f"base model mismatch: {root.name} tensor {module_path}.{tensor}.weight has shape "
                                f"{list(got.shape)}, expected {list(want)} (r={r}, {module} is [{out_size}, "
                                f"{in_size}] in the base model)")
        scaling = float(lora_alpha) / (math.sqrt(r) if use_rslora else r)
        fused = module_path.rsplit(".", 1)[0] + "." + _MODULES[module][0]
        part = LoRAPart(a=a.float().contiguous(), b=(b.float() * scaling).contiguous(), scaling=scaling)
        grouped.setdefault(fused, {})[module] = part
    linears = {prefix: _linear(prefix, parts, shapes) for prefix, parts in grouped.items()}
    return LoRAAdapter(name=name or root.name, path=str(root), rank=max(p.rank for p in _parts(linears)),
                       linears=linears)


def _parts(linears: dict[str, LoRALinear]) -> list[LoRAPart]:
    return [p for linear in linears.values() for p in linear.parts if p is not None]


def _linear(prefix: str, parts: dict[str, LoRAPart], shapes: dict[str, tuple[int, int]]) -> LoRALinear:
    kiln_name = prefix.rsplit(".", 1)[1]
    names = FUSED_MODULES.get(kiln_name, (kiln_name,))
    parallel = "column" if kiln_name in FUSED_MODULES else "row"
    return LoRALinear(prefix=prefix, parallel=parallel, in_features=shapes[names[0]][1], part_names=names,
                      out_sizes=tuple(shapes[n][0] for n in names), parts=tuple(parts.get(n) for n in names))


def _module_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module -> its base weight's (out, in) in this model."""
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def _read_config(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter directory {root} does not exist")
    file = root / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"{root} is not a PEFT adapter: it has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoRAError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def _check_config(config: dict[str, Any], max_lora_rank: int, root: Path) -> tuple[int, float]:
    """(r, lora_alpha) after refusing every setting kiln cannot serve."""
    file = root / CONFIG_FILE
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoRAError(f"{file}: peft_type={peft_type!r} is not supported; kiln serves 'LORA' adapters only")
    for key, why in _UNSUPPORTED_KEYS.items():
        if config.get(key):
            raise LoRAError(f"{file}: {key}={config[key]!r} is not supported ({why}); kiln serves plain LoRA")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{file}: bias={config['bias']!r} is not supported (trained biases change the base "
                        f"model); only 'none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{file}: r={rank!r} must be a positive integer")
    if rank > max_lora_rank:
        raise LoRAError(f"{file}: r={rank} exceeds max_lora_rank={max_lora_rank}; raise --max-lora-rank to at "
                        f"least {rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAError(f"{file}: lora_alpha={alpha!r} must be a finite number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAError(f"{file}: {key}={config[key]!r} must be an object of module pattern -> value")
    return rank, float(alpha)


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any, key: str, root: Path) -> Any:
    """PEFT's get_pattern_key: the first pattern P with re.match(rf"(.*\\.)?({P})$", module_path) wins."""
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", module_path):
                return value
        except re.error as e:
            raise LoRAError(f"{root / CONFIG_FILE}: {key} pattern {pattern!r} is not a valid regex: {e}") from e
    return default


def _candidate_paths(c: ModelConfig) -> list[str]:
    """Every module path a target_modules regex may match in a Llama-family model."""
    paths = ["model.embed_tokens", "lm_head"]
    for i in range(c.num_layers):
        paths += [f"model.layers.{i}.{parent}.{m}" for m, (_, parent) in _MODULES.items()]
    return paths


def _check_targets(targets: Any, c: ModelConfig, root: Path) -> None:
    """Refuses target_modules that name an embedding, the lm_head or a module kiln's layers do not have."""
    file = root / CONFIG_FILE
    if targets is None:
        raise LoRAError(f"{file}: target_modules is missing; give module names, 'all-linear' or a regex")
    if isinstance(targets, str):
        if targets == "all-linear":  # PEFT's all-linear leaves the output layer out
            return
        try:
            matched = [p for p in _candidate_paths(c) if re.fullmatch(targets, p)]
        except re.error as e:
            raise LoRAError(f"{file}: target_modules={targets!r} is not a valid regex: {e}") from e
        embeddings = [p for p in matched if p.rsplit(".", 1)[-1] in _EMBEDDINGS]
        if embeddings:
            raise LoRAError(f"{file}: target_modules={targets!r} matches {embeddings}: embedding and lm_head "
                            f"adapters are not supported")
        if not matched:
            raise LoRAError(f"{file}: target_modules={targets!r} matches none of the base model's projections "
                            f"({', '.join(_MODULES)})")
        return
    if not isinstance(targets, list | tuple) or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{file}: target_modules={targets!r} must be a list of module names, 'all-linear' or a regex")
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in _EMBEDDINGS:
            raise LoRAError(f"{file}: target_modules entry {target!r}: embedding and lm_head adapters are not "
                            f"supported")
        if leaf not in _MODULES:
            raise LoRAError(f"{file}: target_modules entry {target!r} is not a module kiln can adapt; supported: "
                            f"{', '.join(_MODULES)}")


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """The adapter file's tensors, names without PEFT's `base_model.model.` prefix."""
    file = root / SAFETENSORS_FILE
    if file.is_file():
        try:
            with safe_open(str(file), framework="pt") as f:
                tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except (SafetensorError, OSError) as e:
            raise LoRAError(f"{file} cannot be read: {e}") from e
    elif (root / BIN_FILE).is_file():
        file = root / BIN_FILE
        try:  # weights_only: tensors and plain containers only, never arbitrary pickled code
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises many types for bad or unsafe pickles
            raise LoRAError(f"{file} is not a plain state dict of tensors (read with weights_only=True): {e}") from e
        if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
            raise LoRAError(f"{file} must hold a dict of tensors")
    else:
        raise LoRAError(f"{root} has no adapter weights: looked for {SAFETENSORS_FILE} and {BIN_FILE}")
    return {(k[len(_PREFIX):] if k.startswith(_PREFIX) else k): v for k, v in tensors.items()}


def _group_modules(tensors: dict[str, torch.Tensor], c: ModelConfig,
                   root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (lora_A, lora_B), each tensor's name, layer and dtype checked."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding" in key or any(f"{e}." in key for e in _EMBEDDINGS):
            raise LoRAError(f"{root.name}: tensor {key}: embedding and lm_head adapters are not supported")
        if "lora_magnitude_vector" in key:
            raise LoRAError(f"{root.name}: tensor {key}: DoRA (use_dora) is not supported")
        match = _KEY.fullmatch(key)
        if match is None or _MODULES.get(match[3], (None, None))[1] != match[2]:
            raise LoRAError(f"{root.name}: tensor {key} is not a LoRA factor of a module kiln can adapt "
                            f"(model.layers.N.self_attn.{{q,k,v,o}}_proj or model.layers.N.mlp.{{gate,up,down}}_proj)")
        layer = int(match[1])
        if layer >= c.num_layers:
            raise LoRAError(f"base model mismatch: {root.name} tensor {key} is for layer {layer}, the base model "
                            f"has {c.num_layers} layers")
        if match[2] == "mlp" and c.moe is not None and c.moe.sparse_layers[layer]:
            raise LoRAError(f"{root.name}: tensor {key}: layer {layer} is a mixture-of-experts layer; LoRA on "
                            f"experts is not supported")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise LoRAError(f"{root.name}: tensor {key} has dtype {tensor.dtype}; expected float32, float16 or "
                            f"bfloat16")
        halves.setdefault(key.rsplit(".", 2)[0], {})[match[4]] = tensor
    if not halves:
        raise LoRAError(f"{root.name}: the adapter file holds no LoRA tensors")
    for module, pair in halves.items():
        missing = {"A", "B"} - set(pair)
        if missing:
            raise LoRAError(f"{root.name}: {module} has no lora_{missing.pop()}.weight")
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}

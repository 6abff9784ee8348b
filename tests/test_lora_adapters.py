"""PEFT LoRA adapters read onto kiln's fused and sharded linears (kiln/checkpoints/peft.py, lora_adapter.py).

Real adapters are made with the `peft` package on a tiny Llama (and the bundled kiln-tiny-code), with lora_B
set to random values (PEFT starts it at zero); for random inputs each of kiln's fused linears' delta must equal
PEFT's per-module LoRA products laid side by side, whole and as tensor-parallel slices put back together.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from lora_util import make_adapter
from model_factory import make_checkpoint, read_config
from safetensors.torch import load_file, save_file

from kiln.checkpoints.lora_adapter import base_shard, shard_adapter
from kiln.checkpoints.peft import LoRAError, read_lora_adapter
from kiln.engine_format.mapping import Mapping
from kiln.model_defs import model_def_for_hf_config
from kiln.model_defs.layers import DecoderForCausalLM, LinearFactory

peft = pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, kiln ModelConfig) of a random tiny Llama: 4 heads, 2 KV heads, 2 layers."""
    path, model = make_checkpoint(tmp_path_factory.mktemp("lora") / "ckpt", tokenizer=False)
    raw = read_config(path)
    return model, model_def_for_hf_config(raw).parse_config(raw)


@pytest.fixture(scope="module")
def bundled():
    raw = json.loads((BUNDLED / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    return model, model_def_for_hf_config(raw).parse_config(raw)


def peft_delta(model, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's own LoRA products of the modules kiln fuses into `fused`, side by side (zeros where none)."""
    parent = fused.split(".")[0]
    pieces = []
    for name in FUSED[fused]:
        module = model.get_submodule(f"base_model.model.model.layers.{layer}.{parent}.{name}")
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            pieces.append(module.lora_B["default"](module.lora_A["default"](x)) * module.scaling["default"])
        else:
            pieces.append(x.new_zeros(x.shape[0], module.out_features))
    return torch.cat(pieces, dim=-1)


def in_features(config, fused: str) -> int:
    return {"self_attn.o_proj": config.num_heads * config.head_dim,
            "mlp.down_proj": config.intermediate_size}.get(fused, config.hidden_size)


def assert_matches_peft(adapter, model, config, expect_linears: set[str] | None = None) -> None:
    seen = set()
    for layer in range(config.num_layers):
        for fused in FUSED:
            prefix = f"model.layers.{layer}.{fused}"
            x = torch.randn(5, in_features(config, fused))
            want = peft_delta(model, layer, fused, x)
            linear = adapter.get(prefix)
            if linear is None:
                assert not want.any(), prefix
                continue
            seen.add(prefix)
            torch.testing.assert_close(linear.delta(x), want, rtol=1e-5, atol=1e-6, msg=prefix)
    if expect_linears is not None:
        assert seen == expect_linears


@pytest.mark.parametrize("lora, expect", [
    (dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), ("qkv_proj", "o_proj")),
    (dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True),
     ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    (dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"]), ("qkv_proj", "gate_up_proj")),
    (dict(r=8, lora_alpha=16, target_modules=r".*\.(k_proj|down_proj)"), ("qkv_proj", "down_proj")),
    (dict(r=8, lora_alpha=16, target_modules="all-linear", rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 12},
          alpha_pattern={"gate_proj": 40}), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
], ids=["attention-r8", "all-linear-r16-rslora", "some-parts", "regex", "rank-alpha-pattern"])
def test_delta_equals_peft(tiny, tmp_path, lora, expect):
    base, config = tiny
    path, model = make_adapter(base, tmp_path / "adapter", **lora)
    adapter = read_lora_adapter(path, config, max_lora_rank=16)
    assert adapter.rank == max([lora["r"], *lora.get("rank_pattern", {}).values()])
    assert_matches_peft(adapter, model, config,
                        {f"model.layers.{i}.{p}.{n}" for i in range(config.num_layers) for n in expect
                         for p in ("self_attn", "mlp") if f"{p}.{n}" in FUSED})
    if "rank_pattern" not in lora:  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, folded into b
        scale = lora["lora_alpha"] / (math.sqrt(lora["r"]) if lora.get("use_rslora") else lora["r"])
        parts = [p for linear in adapter.linears.values() for p in linear.parts if p is not None]
        assert [p.scaling for p in parts] == pytest.approx([scale] * len(parts))


def test_layers_to_transform_and_bin_file(tiny, tmp_path):
    """Only layer 1 adapted; adapter_model.bin (weights_only) reads the same as safetensors would."""
    base, config = tiny
    path, model = make_adapter(base, tmp_path / "adapter", safe=False, r=8, lora_alpha=16,
                               target_modules=["q_proj", "down_proj"], layers_to_transform=[1])
    assert (path / "adapter_model.bin").is_file() and not (path / "adapter_model.safetensors").exists()
    adapter = read_lora_adapter(path, config, max_lora_rank=8, name="sql")
    assert adapter.name == "sql"
    assert_matches_peft(adapter, model, config, {"model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"})
    linear = adapter.get("model.layers.1.self_attn.qkv_proj")
    assert linear.part_names == ("q_proj", "k_proj", "v_proj") and linear.parts[1] is None


def test_bundled_model(bundled, tmp_path):
    base, config = bundled
    path, model = make_adapter(base, tmp_path / "adapter", r=16, lora_alpha=32, target_modules="all-linear",
                               use_rslora=True)
    assert_matches_peft(read_lora_adapter(path, config, max_lora_rank=16), model, config)


@pytest.mark.parametrize("tp_size", [2, 4])  # 2 KV heads: split over 2 ranks, replicated over 4
def test_tensor_parallel_slices_reassemble(tiny, tmp_path, tp_size):
    base, config = tiny
    path, _ = make_adapter(base, tmp_path / "adapter", r=8, lora_alpha=16, target_modules="all-linear")
    whole = read_lora_adapter(path, config, max_lora_rank=8)
    ranks = [shard_adapter(whole, config, Mapping(tp_size, r)) for r in range(tp_size)]
    for rank, sliced in enumerate(ranks):  # each slice fits the layer kiln builds for that rank
        with torch.device("meta"):
            network = DecoderForCausalLM(config, LinearFactory(mapping=Mapping(tp_size, rank)))
        for prefix, linear in sliced.linears.items():
            layer = network.get_submodule(prefix)
            assert linear.shard == layer.shard == base_shard(whole.get(prefix), config, Mapping(tp_size, rank))
            assert (linear.in_features, linear.out_features) == (layer.in_features, layer.out_features), prefix
    for prefix, full in whole.linears.items():
        x = torch.randn(3, full.in_features)
        want = full.delta(x)
        if full.parallel == "row":  # partial sums over each rank's input columns
            got = sum(r.get(prefix).delta(x[:, s:s + n]) for r in ranks for ((s, n),) in [r.get(prefix).shard.slices])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            continue
        covered = torch.zeros(full.out_features, dtype=torch.bool)
        for r in ranks:  # each rank's rows are the whole delta's rows it holds (KV rows may repeat)
            linear = r.get(prefix)
            got = linear.delta(x)
            cols = torch.cat([torch.arange(s, e) for s, e in linear.shard.ranges()])
            torch.testing.assert_close(got, want[:, cols], rtol=1e-5, atol=1e-6)
            covered[cols] = True
        assert covered.all(), prefix


# ---- refusals ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """A valid all-linear r=8 adapter on the tiny model, copied by each refusal test before it edits it."""
    path, _ = make_adapter(tiny[0], tmp_path_factory.mktemp("lora") / "good", r=8, lora_alpha=16,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return path


def edited(saved: Path, tmp_path: Path, **changes) -> Path:
    path = tmp_path / "edited"
    shutil.copytree(saved, path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(peft_type="IA3"), "peft_type='IA3' is not supported"),
    (dict(use_dora=True), "use_dora=True is not supported (DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save=['lm_head'] is not supported"),
    (dict(lora_bias=True), "lora_bias=True is not supported"),
    (dict(bias="lora_only"), "bias='lora_only' is not supported"),
    (dict(r=32), "r=32 exceeds max_lora_rank=16"),
    (dict(r=0), "r=0 must be a positive integer"),
    (dict(lora_alpha="big"), "lora_alpha='big' must be a finite number"),
    (dict(target_modules=["q_proj", "fc1"]), "target_modules entry 'fc1' is not a module kiln can adapt"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "entry 'embed_tokens': embedding and lm_head adapters"),
    (dict(target_modules=["lm_head"]), "entry 'lm_head': embedding and lm_head adapters"),
    (dict(target_modules=".*lm_head"), "matches ['lm_head']: embedding and lm_head adapters"),
    (dict(target_modules=".*\\.fc1"), "target_modules='.*\\\\.fc1' matches none of the base model's projections"),
    (dict(target_modules="(unclosed"), "is not a valid regex"),
    (dict(target_modules=None), "target_modules is missing"),
    (dict(rank_pattern={"q_proj": 64}), "rank r=64 for model.layers.0.self_attn.q_proj must be an integer in "
                                        "[1, max_lora_rank=16]"),
    (dict(rank_pattern={"q_proj": 4}), "base model mismatch: edited tensor model.layers.0.self_attn.q_proj.lora_A"
                                       ".weight has shape [8, 64], expected [4, 64]"),
    (dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication=[[0, 2], [1, 2]] is not supported"),
])
def test_config_refusals(tiny, saved, tmp_path, changes, message):
    with pytest.raises(LoRAError) as e:
        read_lora_adapter(edited(saved, tmp_path, **changes), tiny[1], max_lora_rank=16)
    assert message in str(e.value)


@pytest.mark.parametrize("field, value, tensor", [
    ("hidden_size", 96, "model.layers.0.mlp.down_proj.lora_B.weight has shape [64, 8], expected [96, 8]"),
    ("intermediate_size", 256, "model.layers.0.mlp.down_proj.lora_A.weight has shape [8, 128], expected [8, 256]"),
    ("num_kv_heads", 4, "model.layers.0.self_attn.k_proj.lora_B.weight has shape [32, 8], expected [64, 8]"),
    ("head_dim", 32, "model.layers.0.self_attn.k_proj.lora_B.weight has shape [32, 8], expected [64, 8]"),
    ("num_layers", 1, "model.layers.1.mlp.down_proj.lora_A.weight is for layer 1, the base model has 1 layers"),
])
def test_base_model_mismatch(tiny, saved, field, value, tensor):
    config = tiny[1]
    layers = value if field == "num_layers" else config.num_layers
    changed = replace(config, **{field: value, "layer_sliding_windows": (0,) * layers, "layer_rope": (True,) * layers})
    with pytest.raises(LoRAError, match="base model mismatch") as e:
        read_lora_adapter(saved, changed, max_lora_rank=16)
    assert tensor in str(e.value)


@pytest.mark.parametrize("key, message", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding and lm_head adapters are not supported"),
    ("base_model.model.lm_head.lora_A.weight", "embedding and lm_head adapters are not supported"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA (use_dora) is not supported"),
    ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "is not a LoRA factor of a module kiln can adapt"),
    ("base_model.model.model.layers.0.mlp.experts.0.w1.lora_A.weight", "is not a LoRA factor of a module"),
])
def test_tensor_refusals(tiny, saved, tmp_path, key, message):
    path = edited(saved, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({**tensors, key: torch.zeros(8, 64)}, path / "adapter_model.safetensors")
    with pytest.raises(LoRAError) as e:
        read_lora_adapter(path, tiny[1], max_lora_rank=16)
    assert key.removeprefix("base_model.model.") in str(e.value) and message in str(e.value)


def test_file_refusals(tiny, saved, tmp_path):
    config = tiny[1]
    with pytest.raises(LoRAError, match="does not exist"):
        read_lora_adapter(tmp_path / "nowhere", config, max_lora_rank=16)
    with pytest.raises(LoRAError, match="has no adapter_config.json"):
        read_lora_adapter(tmp_path, config, max_lora_rank=16)
    path = edited(saved, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="no adapter weights: looked for adapter_model.safetensors and adapter_model.bin"):
        read_lora_adapter(path, config, max_lora_rank=16)
    torch.save({"weights": tensors, "hook": print}, path / "adapter_model.bin")  # a pickle that names a function
    with pytest.raises(LoRAError, match="is not a plain state dict of tensors"):
        read_lora_adapter(path, config, max_lora_rank=16)
    half = {k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}
    save_file(half, path / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="model.layers.0.self_attn.q_proj has no lora_B.weight"):
        read_lora_adapter(path, config, max_lora_rank=16)
    save_file({k: v.to(torch.int8) for k, v in tensors.items()}, path / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="has dtype torch.int8"):
        read_lora_adapter(path, config, max_lora_rank=16)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="adapter_config.json is not valid JSON"):
        read_lora_adapter(path, config, max_lora_rank=16)

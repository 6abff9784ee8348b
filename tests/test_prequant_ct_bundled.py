"""compressed-tensors checkpoints of the bundled model (examples/kiln-tiny-code), made here by the
compressed-tensors calls llm-compressor makes to save one, for the two presets that need no calibration data:
W4A16 (pack-quantized, int4 symmetric per group of 128) and FP8_DYNAMIC (float-quantized, FP8 per-channel
weights, dynamic per-token FP8 activations). kiln's engine of each scores the held-out text as transformers'
own loading of the checkpoint does (its compressed-tensors integration decompresses the weights and
fake-quantizes the activations).

CI has no llm-compressor (it pins an older transformers), so the test does what its `oneshot` +
`save_pretrained(save_compressed=True)` do for these presets: `apply_quantization_config`, each weight's
scale from compressed-tensors' `calculate_qparams` over the min / max its memoryless min-max observer takes,
then `ModelCompressor.from_pretrained_model` / `compress_model` / `update_config`. With llmcompressor 0.14.0.1
(compressed-tensors 0.19.0) the same presets give bit-identical tensors; its config.json differs only in
listing every QuantizationArgs default and in the version.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from model_factory import hf_perplexity
from safetensors import safe_open

from kiln.bench.perplexity import perplexity
from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM

compressed_tensors = pytest.importorskip("compressed_tensors")
from compressed_tensors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from compressed_tensors.utils import update_offload_parameter  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SOURCE = EXAMPLES / "kiln-tiny-code"


def _save_compressed(preset: str, out: Path) -> Path:
    """The bundled model quantized with compressed-tensors' preset scheme `preset` on every Linear but lm_head
    (llm-compressor's usual ignore; here lm_head is the tied embedding table anyway), saved compressed in the
    format compressed-tensors infers for it, with the tokenizer kiln needs to score text."""
    model = transformers.AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32).eval()
    config = QuantizationConfig(config_groups={preset: ["Linear"]}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        # llm-compressor's weight observer (memoryless min-max): the min and max of each group of columns, or
        # of each row per channel; calculate_qparams turns them into symmetric scales (zero points all 0).
        w = module.weight.detach()
        w = w.unflatten(-1, (-1, args.group_size)) if args.strategy == "group" else w[:, None, :]
        scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
        update_offload_parameter(module, "weight_scale", scale)
        if hasattr(module, "weight_zero_point"):  # registered while initializing, dropped by the compressor
            update_offload_parameter(module, "weight_zero_point", zero_point)
        module.quantization_status = QuantizationStatus.FROZEN  # calibrated: what compress_model expects
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SOURCE / f, out / f)
    return out


# preset -> (compression format, the tensor that holds layer 0's down_proj codes and its dtype, what engine.json
# records, the relative perplexity difference allowed). Weight-only int4 is the same float32 arithmetic on both
# sides: the two agree to six digits. FP8 per-token activations are not: their 3-bit mantissa turns a
# float32 summation-order difference into a different rounding of some activations, and that moves the
# perplexity a few tenths of a percent (transformers itself: 6.6517 with sdpa attention, 6.6412 with eager;
# kiln: 6.6321 with max_num_tokens 256, 6.6436 with 2048); the unquantized model scores 6.6150 in both.
CASES = {
    "W4A16": ("pack-quantized", "weight_packed", torch.int32,
              dict(qformat="weight_only", bits=4, group_size=128, zero_point=False), 1e-3),
    "FP8_DYNAMIC": ("float-quantized", "weight", torch.float8_e4m3fn,
                    dict(qformat="fp8_dynamic", bits=None, group_size=None, zero_point=False), 1e-2),
}


@pytest.mark.parametrize("preset", list(CASES))
def test_bundled_model_perplexity_equals_transformers_loading(tmp_path, preset):
    """kiln's engine of a compressed-tensors checkpoint scores what transformers' loading of it scores."""
    fmt, codes, codes_dtype, recorded_fields, tolerance = CASES[preset]
    checkpoint = _save_compressed(preset, tmp_path / "checkpoint")
    quantization_config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert quantization_config["format"] == fmt and quantization_config["quantization_status"] == "compressed"
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        assert f.get_tensor(f"model.layers.0.mlp.down_proj.{codes}").dtype == codes_dtype

    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dtype="float32"), progress=False)
    recorded = json.loads((engine / "engine.json").read_text())["build_config"]["quantization"]
    assert recorded["source"].startswith(f"compressed-tensors {compressed_tensors.__version__} {fmt}: ")
    # With tied embeddings the engine has no lm_head layer of its own (logits come off the embedding table),
    # so no layer is left out.
    assert {k: recorded[k] for k in recorded_fields} == recorded_fields and recorded["exclude_modules"] == []

    text = (EXAMPLES / "heldout-sample.txt").read_text()
    kiln = perplexity(LLM(engine, max_num_tokens=256), text)
    ids = transformers.AutoTokenizer.from_pretrained(SOURCE).encode(text)
    assert len(ids) == kiln.num_tokens  # the same tokens on both sides

    model, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                                    output_loading_info=True)
    # Every tensor of the checkpoint loaded, none re-initialized (as packed asymmetric zero points would be:
    # see test_prequant_compressed_tensors.py; both schemes here are symmetric and store none).
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    reference, _ = hf_perplexity(model.eval(), ids, kiln.window_len)
    print(f"{preset}: kiln {kiln.perplexity:.4f}, transformers {reference:.4f}")
    assert abs(kiln.perplexity / reference - 1) < tolerance, (kiln.perplexity, reference)

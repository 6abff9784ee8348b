"""Makes the compressed-tensors test checkpoints under tests/fixtures/compressed_tensors/<scheme>/ with
llm-compressor's `oneshot`, from one tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads,
intermediate 128, vocab 320, float32) with a word-level tokenizer whose tokens are "t2" ... "t319"
(ids 2..319; <s> = 0, </s> = 1), which llm-compressor wants alongside a calibration set.

llm-compressor pins an older transformers than kiln's, so it gets its own virtual environment:

    python3 -m venv /tmp/llmc-venv
    /tmp/llmc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/llmc-venv/bin/python scripts/make_compressed_tensors_fixtures.py [--output tests/fixtures/compressed_tensors]

Made with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0, torch 2.13.0+cpu (CPU).
The weights and the calibration token ids are seeded, so a rerun with these versions gives the same
checkpoints. Static schemes (FP8, INT8 static, the FP8 KV cache) calibrate on 16 random sequences of 32
token ids. Each checkpoint is a config.json, a generation_config.json, a recipe.yaml and one
model.safetensors of about 200-300 KB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
              initializer_range=0.1, tie_word_embeddings=False)
SEED = 0
CALIB_SAMPLES, CALIB_LEN = 16, 32


def _args(**kw) -> QuantizationArgs:
    return QuantizationArgs(**kw)


FP8_TENSOR = dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
FP8_CHANNEL = dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
FP8_TOKEN = dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
INT8_CHANNEL = dict(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)

# scheme directory -> (weights, input_activations, kv_cache_scheme, ignore). The W4A16 checkpoint ignores
# all of layer 1's q/k/v (kiln keeps its fused qkv_proj in float) and layer 0's down_proj as well.
SCHEMES = {
    "fp8": (FP8_TENSOR, FP8_TENSOR, None, ["lm_head"]),
    "fp8_dynamic": (FP8_CHANNEL, FP8_TOKEN, None, ["lm_head"]),
    "fp8_kv": (FP8_CHANNEL, FP8_TOKEN, FP8_TENSOR, ["lm_head"]),
    "fp8_block": (dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32], symmetric=True,
                       dynamic=False),
                  dict(num_bits=8, type="float", strategy="group", group_size=32, symmetric=True, dynamic=True),
                  None, ["lm_head"]),
    "w8a8_int8": (INT8_CHANNEL, dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True),
                  None, ["lm_head"]),
    "w8a8_int8_static": (INT8_CHANNEL, dict(num_bits=8, type="int", strategy="tensor", symmetric=True,
                                            dynamic=False), None, ["lm_head"]),
    "w4a16": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True, dynamic=False), None,
              None, ["lm_head", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                     "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"]),
    "w4a16_asym": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False, dynamic=False),
                   None, None, ["lm_head"]),
    "w8a16": (dict(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False), None, None,
              ["lm_head"]),
    "w8a16_asym": (dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=False, dynamic=False),
                   None, None, ["lm_head"]),
}


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(**CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, CONFIG["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="t2")


def calibration_data() -> Dataset:
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(2, CONFIG["vocab_size"], (CALIB_SAMPLES, CALIB_LEN), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def save_float_model(path: Path) -> Path:
    """oneshot reads the model's config.json from disk (model.config.name_or_path), so it starts from a
    saved one."""
    tiny_llama().save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def make(name: str, float_model: Path, output: Path) -> Path:
    weights, inputs, kv, ignore = SCHEMES[name]
    scheme = QuantizationScheme(targets=["Linear"], weights=_args(**weights),
                                input_activations=None if inputs is None else _args(**inputs))
    modifier = QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore,
                                    kv_cache_scheme=None if kv is None else _args(**kv))
    static = (inputs is not None and not inputs["dynamic"]) or kv is not None
    tokenizer = word_tokenizer()
    model = oneshot(model=str(float_model), recipe=modifier, processor=tokenizer, precision="float32",
                    dataset=calibration_data() if static else None,
                    num_calibration_samples=CALIB_SAMPLES, max_seq_length=CALIB_LEN,
                    shuffle_calibration_samples=False)
    path = output / name
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, save_compressed=True)
    tokenizer.save_pretrained(path)
    for f in path.iterdir():
        f.chmod(0o644)  # the safetensors file is written private (0600); fixtures are plain files
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "tests" / "fixtures" / "compressed_tensors")
    parser.add_argument("--only", nargs="*", choices=sorted(SCHEMES), help="make only these schemes")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        float_model = save_float_model(Path(tmp) / "float")
        for name in args.only or SCHEMES:
            path = make(name, float_model, args.output)
            config = json.loads((path / "config.json").read_text())["quantization_config"]
            size = sum(f.stat().st_size for f in path.iterdir())
            print(f"{name}: format {config['format']}, {size / 1024:.0f} KB in {path}")


if __name__ == "__main__":
    main()

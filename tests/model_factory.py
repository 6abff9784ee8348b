"""Tiny random-weight Hugging Face checkpoints for tests, made on the spot with transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
from tokenizer_factory import VOCAB_SIZE, make_test_tokenizer

_CONFIG_CLASSES = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "MistralForCausalLM": transformers.MistralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "MixtralForCausalLM": transformers.MixtralConfig,
    "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    "Starcoder2ForCausalLM": transformers.Starcoder2Config,
    "Olmo2ForCausalLM": transformers.Olmo2Config,
    "GraniteForCausalLM": transformers.GraniteConfig,
    "SmolLM3ForCausalLM": transformers.SmolLM3Config,
    "Gemma2ForCausalLM": transformers.Gemma2Config,
    "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    "Phi3ForCausalLM": transformers.Phi3Config,
    "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
    "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
}

BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
            eos_token_id=1, initializer_range=0.1)


def make_checkpoint(path: Path, architecture: str = "LlamaForCausalLM", *, seed: int = 0,
                    dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                    **overrides) -> tuple[Path, transformers.PreTrainedModel]:
    """Saves a random tiny model of `architecture` (+ the test tokenizer) to `path`; returns (path, model).

    initializer_range is larger than HF's default so logits have clear winners and greedy comparisons
    are not decided by float noise.
    """
    path.mkdir(parents=True, exist_ok=True)
    config = _CONFIG_CLASSES[architecture](**{**BASE, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(dtype).eval()
    model.save_pretrained(path)
    if tokenizer:
        make_test_tokenizer(path)
    return path, model


def randomized_checkpoint(path: Path, architecture: str, **overrides) -> tuple[Path, transformers.PreTrainedModel]:
    """`make_checkpoint`'s model with every 1-d tensor (biases, norm weights) randomized before it is saved:
    transformers starts them at 0 and 1, which would hide a bias or norm weight kiln reads from the wrong place.
    The model families' parity tests start from it."""
    path.mkdir(parents=True, exist_ok=True)
    config = _CONFIG_CLASSES[architecture](**{**BASE, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    make_test_tokenizer(path)
    return path, model


def hf_prompt_logprobs(model: transformers.PreTrainedModel, prompt: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first, from one forward pass."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def build_case(name: str, cases: dict, tmp_path_factory, limits: dict, make=randomized_checkpoint):
    """A family test's `case` fixture value: (name, checkpoint, engine, hf model) for `cases[name]` =
    (architecture, config overrides), the checkpoint made by `make` and built with `limits`."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    architecture, overrides = cases[name]
    tmp = tmp_path_factory.mktemp(name)
    checkpoint, model = make(tmp / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp / "engine", BuildConfig(**limits), progress=False)
    return name, checkpoint, engine, model


def hf_greedy(model: transformers.PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored, as the reference."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def make_engine(tmp: Path, architecture: str = "LlamaForCausalLM", **build_options) -> tuple[Path, Path,
                                                                                              transformers.PreTrainedModel]:
    """A tiny checkpoint under tmp/ckpt built into tmp/engine; returns (checkpoint, engine, hf_model)."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    checkpoint, model = make_checkpoint(tmp / "ckpt", architecture)
    engine = build_engine(checkpoint, tmp / "engine", BuildConfig(**build_options), progress=False)
    return checkpoint, engine, model


def hf_perplexity(model, token_ids: list[int], window_len: int) -> tuple[float, int]:
    """transformers' perplexity over the same consecutive windows as kiln's perplexity (each window alone,
    its first token unscored): (perplexity, scored tokens)."""
    from kiln.bench.perplexity import split_windows

    nll, count = 0.0, 0
    for window in split_windows(token_ids, window_len):
        ids = torch.tensor([window])
        with torch.no_grad():
            logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        nll -= logprobs.gather(-1, ids[0, 1:, None]).sum().item()
        count += len(window) - 1
    return math.exp(nll / count), count

"""`kiln build --eval-text`: the built engine's perplexity on a text next to the full-precision engine's.

The full-precision engine is built into a temporary directory from the same checkpoint and settings, and
both are scored by `kiln eval perplexity`'s code on the CPU reference path or the build device.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path


def compare_perplexity(checkpoint: Path, engine: Path, config, text: str) -> str:
    from kiln.bench.perplexity import perplexity
    from kiln.builder.build import build_engine
    from kiln.runtime import LLM

    def score(engine_dir: Path):
        return perplexity(LLM(engine_dir, device=config.device), text)

    start = time.perf_counter()
    quantized = score(engine)
    if not config.quantizes:
        return f"perplexity on --eval-text: {quantized.perplexity:.4f} over {quantized.num_scored_tokens} tokens"
    with tempfile.TemporaryDirectory(prefix="kiln-eval-") as tmp:
        full_config = dataclasses.replace(config, qformat="full_prec", kv_cache_dtype="auto")
        full = score(build_engine(checkpoint, Path(tmp) / "full_prec", full_config, progress=False))
    change = 100.0 * (quantized.perplexity / full.perplexity - 1.0)
    kv = f" + {config.kv_cache_dtype} KV cache" if config.kv_cache_dtype != "auto" else ""
    what = config.qformat.name + kv
    return (f"perplexity on --eval-text ({quantized.num_scored_tokens} tokens): full precision {full.perplexity:.4f}, "
            f"{what} {quantized.perplexity:.4f} ({change:+.2f}%) [{time.perf_counter() - start:.1f}s]")

"""docs/quantization.md's accuracy table: kiln-tiny-code built in each format (default calibration: kiln's
sample, up to 512 samples, --calib-max-seq-len 512), its `kiln eval perplexity` on the held-out sample next
to the full-precision engine's, the engine size and the calibration time.

    python scripts/quant_accuracy_table.py [--calib-size N] [--out /tmp/kiln-quant-table]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kiln.bench.perplexity import perplexity
from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "kiln-tiny-code"
HELDOUT = (ROOT / "examples" / "heldout-sample.txt").read_text()
CASES = [("full_prec", "auto"), ("fp8", "auto"), ("int8_sq", "auto"), ("int4_awq", "auto"), ("int8_wo", "auto"),
         ("int4_wo", "auto"), ("full_prec", "fp8"), ("full_prec", "int8"), ("fp8", "fp8"), ("int4_awq", "fp8")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib-size", type=int, default=None)  # None: kiln build's default (up to 512)
    parser.add_argument("--out", default="/tmp/kiln-quant-table")
    args = parser.parse_args()
    rows, base = [], None
    for qformat, kv in CASES:
        out = Path(args.out) / f"{qformat}-{kv}"
        start = time.perf_counter()
        build_engine(MODEL, out, BuildConfig(dtype="float32", qformat=qformat, kv_cache_dtype=kv,
                                             calib_size=args.calib_size), progress=False)
        build_s = time.perf_counter() - start
        ppl = perplexity(LLM(out), HELDOUT).perplexity
        base = base or ppl
        quant = json.loads((out / "engine.json").read_text())["build_config"]["quantization"] or {}
        calib = (quant.get("calibration") or {}).get("seconds")
        size = (out / "rank0.safetensors").stat().st_size / 2**20
        rows.append(f"| `{qformat}` | {'model dtype' if kv == 'auto' else kv} | {ppl:.4f} | "
                    f"{100 * (ppl / base - 1):+.2f}% | {size:.1f} MiB | "
                    f"{'—' if calib is None else f'{calib:.0f} s'} | {build_s:.0f} s |")
        print(rows[-1], flush=True)
    print("| qformat | KV cache | perplexity | vs full precision | engine weights | calibration | build |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

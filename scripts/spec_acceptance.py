"""Acceptance of speculative decoding on the bundled pair, for docs/features.md's table.

Runs kiln-tiny-code with each proposer (its draft model, n-gram lookup) for K = 1..5, greedy and at
temperature 0.8 (seeded), over windows of the held-out code sample (`examples/heldout-sample.txt`, text the
models were not trained on), and prints one markdown row per run: mean accepted length, acceptance rate and
acceptance per position (vLLM's definitions: 1 + accepted / drafts; accepted / draft tokens; steps whose
draft i was accepted / steps).

    kiln build --checkpoint examples/kiln-tiny-code --output /tmp/tiny --dtype float32
    kiln build --checkpoint examples/kiln-tiny-code-draft --output /tmp/tiny-draft --dtype float32
    python scripts/spec_acceptance.py --engine /tmp/tiny --draft /tmp/tiny-draft
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.bench.offline import text_prompts
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.speculative import SpeculativeConfig

HELDOUT = Path(__file__).resolve().parent.parent / "examples" / "heldout-sample.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="kiln-tiny-code engine")
    parser.add_argument("--draft", required=True, help="kiln-tiny-code-draft engine")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-k", type=int, default=5)
    args = parser.parse_args()

    with LLM(args.engine, num_kv_blocks=256) as plain:
        ids = list(plain.tokenizer.encode(HELDOUT.read_text()))
    prompts = text_prompts(ids, args.num_prompts, args.input_len, seed=0)
    print("| proposer | K | temperature | mean accepted length | acceptance rate | acceptance per position |")
    print("| --- | --- | --- | --- | --- | --- |")
    for method in ("draft_model", "ngram"):
        for temperature in (0.0, 0.8):
            for k in range(1, args.max_k + 1):
                config = SpeculativeConfig(method, k, model=args.draft if method == "draft_model" else None)
                params = [SamplingParams(max_tokens=args.output_len, temperature=temperature, ignore_eos=True,
                                         seed=None if temperature == 0 else i) for i in range(len(prompts))]
                with LLM(args.engine, speculative_config=config) as llm:
                    llm.generate(prompts, params)
                    s = llm.speculation_stats()
                per_position = " / ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
                name = "draft model" if method == "draft_model" else "n-gram (1..4)"
                print(f"| {name} | {k} | {temperature:g} | {s['mean_accepted_length']:.2f} | "
                      f"{s['acceptance_rate']:.2f} | {per_position} |", flush=True)


if __name__ == "__main__":
    main()

"""Acceptance of speculative decoding on the bundled pair, for docs/features.md's table.

Runs kiln-tiny-code with each proposer (its draft model, n-gram lookup, and with `--eagle3 HEAD` the EAGLE-3
head `examples/kiln-tiny-code-eagle3`) for K = 1..5, greedy and at
temperature 0.8 (seeded), over windows of the held-out code sample (`examples/heldout-sample.txt`, text the
models were not trained on), and prints one markdown row per run: mean accepted length, acceptance rate and
acceptance per position (vLLM's definitions: 1 + accepted / drafts; accepted / draft tokens; steps whose
draft i was accepted / steps). `--time-drafts` then times each model proposer at batch 1 (K = 4, greedy, a few
windows one at a time): wall time inside `propose` (its catch-up on accepted tokens included) per draft token.

    kiln build --checkpoint examples/kiln-tiny-code --output /tmp/tiny --dtype float32
    kiln build --checkpoint examples/kiln-tiny-code-draft --output /tmp/tiny-draft --dtype float32
    python scripts/spec_acceptance.py --engine /tmp/tiny --draft /tmp/tiny-draft \
        --eagle3 examples/kiln-tiny-code-eagle3 --trees 2:8,4:16 --time-drafts
"""

from __future__ import annotations

import argparse
import time
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
    parser.add_argument("--eagle3", help="an EAGLE-3 head directory (examples/kiln-tiny-code-eagle3)")
    parser.add_argument("--methods", default="draft_model,ngram,eagle3", help="comma-separated proposers to run")
    parser.add_argument("--trees", default="", metavar="TOPK:NODES,...",
                        help="also EAGLE-3 tree drafts: eagle_topk:num_draft_tokens pairs, each for K = 2..max-k")
    parser.add_argument("--time-drafts", action="store_true", help="also time each model proposer per draft token")
    args = parser.parse_args()
    models = {"draft_model": args.draft, "eagle3": args.eagle3, "ngram": None}
    names = {"draft_model": "draft model", "ngram": "n-gram (1..4)", "eagle3": "EAGLE-3 head"}
    methods = [m for m in args.methods.split(",") if m in names and (m != "eagle3" or args.eagle3)]

    with LLM(args.engine, num_kv_blocks=256) as plain:
        ids = list(plain.tokenizer.encode(HELDOUT.read_text()))
    prompts = text_prompts(ids, args.num_prompts, args.input_len, seed=0)
    print("| proposer | K | temperature | mean accepted length | acceptance rate | acceptance per position |")
    print("| --- | --- | --- | --- | --- | --- |")
    runs = [(m, names[m], 1, None) for m in methods]
    for pair in filter(None, args.trees.split(",")):
        topk, nodes = (int(v) for v in pair.split(":"))
        runs.append(("eagle3", f"EAGLE-3 tree (top-{topk}, {nodes} nodes)", topk, nodes))
    for method, name, topk, nodes in runs:
        for temperature in (0.0, 0.8):
            for k in range(1 if nodes is None else 2, args.max_k + 1):
                config = SpeculativeConfig(method, k, model=models[method], eagle_topk=topk, num_draft_tokens=nodes)
                params = [SamplingParams(max_tokens=args.output_len, temperature=temperature, ignore_eos=True,
                                         seed=None if temperature == 0 else i) for i in range(len(prompts))]
                with LLM(args.engine, speculative_config=config) as llm:
                    llm.generate(prompts, params)
                    s = llm.speculation_stats()
                per_position = " / ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
                print(f"| {name} | {k} | {temperature:g} | {s['mean_accepted_length']:.2f} | "
                      f"{s['acceptance_rate']:.2f} | {per_position} |", flush=True)
    if args.time_drafts:
        for method in (m for m in ("draft_model", "eagle3") if models[m]):
            print(f"{names[method]}: {time_drafts(args.engine, method, models[method], prompts[:4], args.output_len)}")


def time_drafts(engine: str, method: str, model: str, prompts: list, output_len: int) -> str:
    """Batch-1 cost of a proposer: ms inside `propose` per draft token over `prompts` run one at a time (K = 4)."""
    with LLM(engine, speculative_config=SpeculativeConfig(method, 4, model=model)) as llm:
        proposer = llm.engine.speculator.proposer
        inner, spent = proposer.propose, [0.0, 0]

        def timed(requests):
            t0 = time.perf_counter()
            out = inner(requests)
            spent[0] += time.perf_counter() - t0
            spent[1] += sum(len(p.token_ids) for p in out.values())
            return out

        proposer.propose = timed
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm up
        spent[:] = [0.0, 0]
        for prompt in prompts:
            llm.generate([prompt], SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    return f"{1e3 * spent[0] / max(spent[1], 1):.2f} ms per draft token ({spent[1]} draft tokens, batch 1)"


if __name__ == "__main__":
    main()

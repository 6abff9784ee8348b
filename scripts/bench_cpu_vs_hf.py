"""kiln against transformers' `generate` on the CPU, measured interleaved in one process.

    python scripts/bench_cpu_vs_hf.py [--engine DIR] [--checkpoint examples/kiln-tiny-code]
        [--batch-sizes 1 16] [--output-len 128] [--repeats 5] [--threads N] [--dtype float32]
        [--workload equal|mixed]

Without --engine it builds an engine of --checkpoint in --dtype (float32) into a temporary directory.
Both sides get the same code prompts (token ids from the checkpoint's tokenizer, BOS first), greedy
decoding and exactly --output-len new tokens (kiln: ignore_eos; transformers: min_new_tokens), the same
torch thread count, and run one after the other in each repetition, so a noisy machine slows both alike.
Transformers gets a batch padded on the left (its usual batched generate); kiln packs the prompts with no
padding and batches them in flight. Tokens/s counts generated tokens over the wall time of the whole call
(prefill included). The table shows the median and the best of --repeats timed runs (after one untimed
warm-up of each) and the ratios kiln / transformers of the medians and of the bests.

--workload mixed gives the requests of a batch different lengths, as a server's are: prompts of 16 to 384
tokens (windows of the calibration sample kiln ships, BOS first) and 32 to 2 x --output-len new tokens
(from --output-len itself where that is under 32),
the two spread independently over the batch. kiln gives each request its own max_tokens; transformers'
batched generate runs every row until the longest is done (a static batch cannot let one row stop early
and another join), and only each request's own tokens count, for both.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "def read_json(path):\n    with open(path) as f:",
    "# Parse command line arguments\nimport argparse\n\nparser = argparse.ArgumentParser(",
    "def is_prime(n: int) -> bool:",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items",
    "import logging\n\nlogger = logging.getLogger(__name__)\n\n\ndef run(",
    "def merge(a, b):\n    result = []",
    "class Config(object):\n    \"\"\"Holds the settings.\"\"\"\n\n    def __init__(self, **kwargs):",
    "for i in range(10):",
    "def flatten(nested):\n    for item in nested:",
    "try:\n    import json\nexcept ImportError:",
    "def add(a, b):",
    "with open('data.csv') as f:\n    reader = csv.reader(f)\n    for row in reader:",
]


def prompt_ids(tokenizer, batch_size: int) -> list[list[int]]:
    ids = []
    for i in range(batch_size):
        tokens = tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]
        if tokenizer.bos_token_id is not None and (not tokens or tokens[0] != tokenizer.bos_token_id):
            tokens = [tokenizer.bos_token_id, *tokens]
        ids.append(tokens)
    return ids


def mixed_requests(tokenizer, batch_size: int, output_len: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16..384 tokens and output lengths of min(32, output_len)..2 * output_len, spread over the
    batch, the output lengths in another order than the prompt lengths (deterministic)."""
    sample = Path(__file__).resolve().parents[1] / "kiln" / "quant" / "data" / "calibration-sample.txt"
    text_ids = tokenizer(sample.read_text()[:200_000])["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    span, low = max(1, batch_size - 1), min(32, output_len)
    prompts, outputs, offset = [], [], 0
    for i in range(batch_size):
        length = 16 + i * (384 - 16) // span
        prompts.append(bos + text_ids[offset:offset + length - len(bos)])
        offset += length
        outputs.append(low + (i * 7 % batch_size) * (2 * output_len - low) // span)
    return prompts, outputs


def build_engine_into(checkpoint: str, directory: Path, dtype: str) -> Path:
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    return build_engine(checkpoint, directory / "engine", BuildConfig(dtype=dtype, device="cpu"), progress=False)


class KilnRunner:
    def __init__(self, engine: Path) -> None:
        from kiln.runtime import LLM

        self.llm = LLM(engine, device="cpu")

    def __call__(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        from kiln.runtime import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
        return [out.token_ids for out in self.llm.generate(prompts, params)]


class HFRunner:
    def __init__(self, checkpoint: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        width, steps = max(len(p) for p in prompts), max(output_lens)
        # Left padding, as batched generation with a decoder-only model needs; every row runs `steps` tokens.
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                  max_new_tokens=steps, min_new_tokens=steps, pad_token_id=self.pad_id)
        return [row[:n] for row, n in zip(out[:, width:].tolist(), output_lens)]


def timed(fn, requests) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = fn(*requests)
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="a CPU engine of --checkpoint (default: build one in --dtype)")
    p.add_argument("--checkpoint", default="examples/kiln-tiny-code")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--workload", default="equal", choices=("equal", "mixed"),
                   help="equal: --output-len tokens for every short prompt; mixed: lengths as a server's differ")
    args = p.parse_args()

    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Path(args.engine) if args.engine else build_engine_into(args.checkpoint, Path(tmp), args.dtype)
        kiln, hf = KilnRunner(engine), HFRunner(args.checkpoint, dtype)
        requests = {b: (mixed_requests(tokenizer, b, args.output_len) if args.workload == "mixed" else
                        (prompt_ids(tokenizer, b), [args.output_len] * b)) for b in args.batch_sizes}
        times: dict[tuple[str, int], list[float]] = {}
        agreement: dict[int, str] = {}
        for batch_size in args.batch_sizes:
            _, kiln_tokens = timed(kiln, requests[batch_size])  # warm-up, and the outputs to compare
            _, hf_tokens = timed(hf, requests[batch_size])
            same = sum(k == h for k, h in zip(kiln_tokens, hf_tokens))
            agreement[batch_size] = f"{same}/{batch_size}"
        for _ in range(args.repeats):
            for batch_size in args.batch_sizes:
                for name, fn in (("kiln", kiln), ("transformers", hf)):
                    seconds, tokens = timed(fn, requests[batch_size])
                    assert [len(t) for t in tokens] == requests[batch_size][1], f"{name} stopped early"
                    times.setdefault((name, batch_size), []).append(seconds)

    what = (f"{args.output_len} new tokens" if args.workload == "equal" else
            f"mixed lengths (prompts 16-384 tokens, {min(32, args.output_len)}-{2 * args.output_len} new tokens)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {what}, greedy, "
          f"{args.repeats} interleaved repeats; tokens/s median (best)")
    print("| batch | kiln tok/s | transformers tok/s | kiln / transformers: medians (bests) | greedy outputs equal |")
    print("| --- | --- | --- | --- | --- |")
    for batch_size in args.batch_sizes:
        tokens = sum(requests[batch_size][1])
        k, h = times[("kiln", batch_size)], times[("transformers", batch_size)]
        k_med, h_med = tokens / statistics.median(k), tokens / statistics.median(h)
        print(f"| {batch_size} | {k_med:.1f} ({tokens / min(k):.1f}) | {h_med:.1f} ({tokens / min(h):.1f}) | "
              f"{k_med / h_med:.2f}x ({min(h) / min(k):.2f}x) | {agreement[batch_size]} |")


if __name__ == "__main__":
    main()

"""The `kiln` command line: build engines and generate from them."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build a Hugging Face checkpoint into an engine",
                       description="Convert, fuse and cast a Hugging Face checkpoint into a kiln engine directory "
                                   "(engine.json, rank0.safetensors, tokenizer/).")
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory (config.json, weights, "
                                                       "tokenizer files)")
    p.add_argument("--output", required=True, help="engine directory to write (replaced if it is an engine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight and activation dtype; auto = the checkpoint's torch_dtype (default: auto)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device type the engine targets; cuda records this GPU (default: cpu)")
    p.add_argument("--max-batch-size", type=int, default=64, help="most requests per step (default: 64)")
    p.add_argument("--max-num-tokens", type=int, default=2048,
                   help="most tokens per step, prefill chunks and decodes together (default: 2048)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="most tokens per request, prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--dummy-weights", action="store_true",
                   help="random weights from config.json alone, no weight files needed (for benchmarks)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from an engine",
                       description="Load an engine and complete one prompt, streaming the text to stdout.")
    p.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--device", default=None, help="device to run on (default: the engine's target)")


def _build(args: argparse.Namespace) -> int:
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    config = BuildConfig(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                         max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
                         kv_block_size=args.kv_block_size, dummy_weights=args.dummy_weights)
    start = time.perf_counter()
    out = build_engine(args.checkpoint, args.output, config)
    print(f"engine written to {out} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kiln.runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    start = time.perf_counter()
    llm = LLM(args.engine, device=args.device)
    loaded = time.perf_counter()
    shown = 0
    out = None
    sys.stdout.write(args.prompt)
    for out in llm.stream(args.prompt, params):
        sys.stdout.write(out.text[shown:])
        sys.stdout.flush()
        shown = len(out.text)
    sys.stdout.write("\n")
    done = time.perf_counter()
    n = len(out.token_ids) if out else 0
    print(f"[{n} tokens, finish_reason={out.finish_reason if out else None}; load {loaded - start:.2f}s, "
          f"generate {done - loaded:.2f}s, {n / max(done - loaded, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Build LLM engines from Hugging Face checkpoints "
                                                              "and generate from them.")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_build(sub)
    _add_generate(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from kiln.builder.build import BuildError
    from kiln.builder.engine_format import EngineError

    try:
        return {"build": _build, "generate": _generate}[args.command](args)
    except (BuildError, EngineError, ValueError) as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

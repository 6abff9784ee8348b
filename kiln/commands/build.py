"""`kiln build`: a Hugging Face checkpoint into an engine directory."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kiln.distribution import install_hint

QFORMAT_HELP = (
    "weight quantization, TensorRT-LLM's names: full_prec (default: the model dtype), fp8 (FP8 E4M3 weights "
    "and activations, per-tensor scales), int8_sq (INT8 SmoothQuant W8A8), int4_awq (INT4 AWQ weight-only, "
    "group --awq-block-size), int8_wo (INT8 weight-only, per channel), int4_wo (INT4 weight-only, per group). "
    f"fp8, int8_sq and int4_awq are calibrated with NVIDIA ModelOpt: {install_hint('quant')}")
CALIB_HELP = (
    "calibration text: a plain-text file, or JSON lines with a 'text' field. Default: a sample that ships "
    "with kiln (Python standard-library source with its English docstrings). Calibrate a chat model on "
    "chat data: pass your own")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build a Hugging Face checkpoint into an engine",
                       description="Convert, fuse, cast and optionally quantize a Hugging Face checkpoint into a "
                                   "kiln engine directory (engine.json, rank<N>.safetensors, tokenizer/).")
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory (config.json, weights, "
                                                       "tokenizer files)")
    p.add_argument("--output", required=True, help="engine directory to write (replaced if it is an engine)")
    p.add_argument("--speculative-target", default=None, metavar="TARGET_ENGINE",
                   help="with an EAGLE-3 head checkpoint (LlamaForCausalLMEagle3): the kiln engine it drafts for; "
                        "builds a head engine for --speculative-mode eagle3 --speculative-model (--dtype auto: the "
                        "target's)")
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
    p.add_argument("--max-beam-width", type=int, default=1,
                   help="most beams a beam-search request may have (SamplingParams n with use_beam_search; each "
                        "beam is a row of max-batch-size) (default: 1)")
    p.add_argument("--dummy-weights", action="store_true",
                   help="random weights from config.json alone, no weight files needed (for benchmarks)")
    p.add_argument("--no-weight-files", action="store_true",
                   help="with --dummy-weights: write no weight files; the runtime draws the random weights on the "
                        "device at load (for models whose weights do not fit the disk)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks the engine is split over, one process and GPU each; writes "
                        "rank0..rank{N-1}.safetensors (default: 1)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="build even if a checkpoint tensor holds NaN or Inf values (warn, naming it, instead of "
                        "refusing); such an engine may generate NaN logits, i.e. empty text")
    p.add_argument("--no-tune", action="store_true",
                   help="with --device cuda: skip timing the kernels' launch settings on this GPU (the runtime then "
                        "uses its shape heuristics; saves the tuning time of a quantized build)")
    p.add_argument("--no-kernels", action="store_true",
                   help="with --device cuda: do not compile the kernels and store them in the engine (kernels/); "
                        "the runtime then compiles them at first use on each machine (half a minute for an 8B "
                        "model), as Triton does by default")
    q = p.add_argument_group("quantization")
    q.add_argument("--qformat", default="full_prec", type=parse_qformat_flag, metavar="QFORMAT", help=QFORMAT_HELP)
    q.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="KV-cache dtype with any --qformat; auto = the model dtype; fp8 and int8 are calibrated "
                        "(per-layer scales) and hold twice the tokens of a 16-bit cache (default: auto)")
    q.add_argument("--awq-block-size", type=int, default=128,
                   help="group size (input columns per scale) of int4_awq and int4_wo (default: 128)")
    q.add_argument("--dequantize", action="store_true",
                   help="dequantize a pre-quantized checkpoint's weights to --dtype at build instead of keeping "
                        "them in its format; for MXFP4 checkpoints (GPT-OSS's experts, kept MXFP4 by default)")
    q.add_argument("--calib-dataset", default=None, metavar="FILE", help=CALIB_HELP)
    q.add_argument("--calib-size", type=int, default=None,
                   help="calibration samples; fewer than asked is warned about (default: up to 512, as many as "
                        "the calibration data gives)")
    q.add_argument("--calib-max-seq-len", type=int, default=512, help="tokens per calibration sample (default: 512)")
    q.add_argument("--eval-text", default=None, metavar="FILE",
                   help="after the build, print the perplexity of the engine on this UTF-8 text next to the "
                        "full-precision engine's, so the cost of a format shows before deploying it")
    p.set_defaults(run=run)


def parse_qformat_flag(name: str):
    """--qformat, parsed here once into its registry entry (kiln.quant.registry.QuantScheme), which BuildConfig
    and the builder take as it is; the valid names are the registry's buildable schemes. argparse calls it only
    when `kiln build` runs (its default too), so the CLI's other commands and --help import no torch."""
    from kiln.quant.base import QuantError
    from kiln.quant.formats import QFORMATS, parse_qformat

    try:
        return parse_qformat(name)
    except QuantError:  # in argparse's own words for a bad choice
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from "
                                         f"{', '.join(map(repr, QFORMATS))})") from None


def run(args: argparse.Namespace) -> int:
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig
    from kiln.builder.eagle3_head import is_head_checkpoint
    from kiln.builder.kernel_store import stored_kernels_line

    from .build_summary import engine_summary
    from .text_file import read_text_arg

    if args.speculative_target is not None or is_head_checkpoint(args.checkpoint):  # an EAGLE-3 head
        return _run_head(args)
    eval_text = read_text_arg(args.eval_text, "--eval-text") if args.eval_text else None  # fail before building
    config = BuildConfig(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                         max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
                         kv_block_size=args.kv_block_size, dummy_weights=args.dummy_weights,
                         weights_at_load=args.no_weight_files, qformat=args.qformat,
                         kv_cache_dtype=args.kv_cache_dtype, awq_block_size=args.awq_block_size,
                         calib_dataset=args.calib_dataset, calib_size=args.calib_size,
                         calib_max_seq_len=args.calib_max_seq_len, tp_size=args.tp_size,
                         tune=not args.no_tune, allow_non_finite=args.allow_non_finite,
                         kernels=args.device == "cuda" and not args.no_kernels,
                         max_beam_width=args.max_beam_width, dequantize=args.dequantize)
    start = time.perf_counter()
    out = build_engine(args.checkpoint, args.output, config)
    dtype = json.loads((out / "engine.json").read_text())["build_config"]["dtype"]
    picked = f" ({dtype}, picked by --dtype auto for {args.device})" if args.dtype == "auto" else f" ({dtype})"
    print(f"engine written to {out}{picked} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(engine_summary(out), file=sys.stderr)
    if kernels_line := stored_kernels_line(out):
        print(kernels_line, file=sys.stderr)
    if eval_text is not None:
        from .build_eval import compare_perplexity

        print(compare_perplexity(Path(args.checkpoint), out, config, eval_text), file=sys.stderr)
    return 0


def _run_head(args: argparse.Namespace) -> int:
    """`kiln build --checkpoint HEAD_DIR --speculative-target TARGET_ENGINE`: a head engine (builder/eagle3_head.py);
    the flags that shape a model engine (quantization, ranks, dummy weights) do not apply to it."""
    from kiln.builder.build import BuildError
    from kiln.builder.eagle3_head import build_head_engine

    for flag, value, default in (("--qformat", args.qformat.name, "full_prec"), ("--tp-size", args.tp_size, 1),
                                 ("--dummy-weights", args.dummy_weights, False),
                                 ("--kv-cache-dtype", args.kv_cache_dtype, "auto")):
        if value != default:
            raise BuildError(f"{flag} {value} does not apply to an EAGLE-3 head engine (--speculative-target)")
    start = time.perf_counter()
    out = build_head_engine(args.checkpoint, args.output, args.speculative_target, args.dtype)
    print(f"EAGLE-3 head engine written to {out} for {args.speculative_target} in {time.perf_counter() - start:.1f}s",
          file=sys.stderr)
    return 0

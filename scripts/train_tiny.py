"""Trains kiln's bundled models, `kiln-tiny-code` and its draft `kiln-tiny-code-draft`, on Python source.

The corpus is Python source that every Python installation has: the standard library and the installed
site-packages of the Python that runs this script (no network, no hub). Packages in HELD_OUT never enter
training (not even as vendored copies inside other packages); they are the held-out evaluation set.

Everything is seeded. The data order, the tokenizer and the initial weights depend only on the seed and
the files found; the number of optimizer steps is measured to fit the time budget the first time and
written to the model card, and `--steps N` repeats a run exactly on the same corpus.

Usage (on one GPU):
    python scripts/train_tiny.py --model main  --out OUT/kiln-tiny-code
    python scripts/train_tiny.py --model draft --out OUT/kiln-tiny-code-draft --tokenizer OUT/kiln-tiny-code
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SEED = 1234
VOCAB_SIZE = 8192
CONTEXT = 1024
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"  # ids 0, 1, 2
CHAT_TEMPLATE = Path(__file__).resolve().with_name("tiny_chat_template.jinja")

# Held out for evaluation: whole stdlib packages and whole site-packages (vendored copies included).
HELD_OUT = ("json", "email", "tomllib", "requests", "click")
# Never read: caches, and trees that are data or tests of the interpreter's C layer rather than code.
SKIP_DIRS = ("__pycache__", "site-packages", "dist-packages", "idlelib", "lib2to3", "ensurepip")
MAX_FILE_BYTES = 400_000     # larger .py files are generated tables, not code people write
MAX_PACKAGE_BYTES = 30_000_000  # so that torch or sympy cannot drown the rest
MAX_CORPUS_BYTES = 480_000_000
TOKENIZER_SAMPLE_BYTES = 48_000_000


@dataclass(frozen=True)
class Preset:
    """One model's shape and optimizer settings."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    batch_size: int  # sequences of CONTEXT tokens per step
    lr: float
    warmup_steps: int
    time_budget_s: float  # the whole training loop, compilation included


PRESETS = {
    "main": Preset("kiln-tiny-code", 384, 8, 6, 2, 1024, batch_size=64, lr=2e-3, warmup_steps=100,
                   time_budget_s=330.0),
    "draft": Preset("kiln-tiny-code-draft", 256, 4, 4, 2, 512, batch_size=64, lr=3e-3, warmup_steps=100,
                    time_budget_s=150.0),
}


# ---- corpus --------------------------------------------------------------------------------------
def source_roots() -> list[Path]:
    """The standard library, then the site-packages of this interpreter, without repeats."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def collect_corpus(max_bytes: int = MAX_CORPUS_BYTES) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    """Returns (train docs, held-out docs, summary); a doc is (path relative to its root, text).

    Files are visited in sorted order; identical contents are kept once (vendored copies).
    """
    train: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    seen: set[str] = set()
    per_package: dict[str, int] = {}
    total = 0
    for root in source_roots():
        files = sorted(p for p in root.rglob("*.py") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            parts = rel.parts
            if any(part in SKIP_DIRS for part in parts[:-1]) or "kiln" == parts[0]:
                continue
            size = path.stat().st_size
            if size == 0 or size > MAX_FILE_BYTES:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            stem = [p.removesuffix(".py") for p in parts]
            if any(name in HELD_OUT for name in stem):
                held.append((str(rel), text))
                continue
            package = stem[0]
            if per_package.get(package, 0) + size > MAX_PACKAGE_BYTES or total + size > max_bytes:
                continue
            per_package[package] = per_package.get(package, 0) + size
            total += size
            train.append((str(rel), text))
    summary = {
        "roots": [str(r) for r in source_roots()],
        "python": sys.version.split()[0],
        "train_files": len(train),
        "train_bytes": total,
        "heldout_files": len(held),
        "heldout_bytes": sum(len(t.encode()) for _, t in held),
        "held_out_packages": list(HELD_OUT),
        "largest_packages": sorted(per_package.items(), key=lambda kv: -kv[1])[:12],
    }
    return train, held, summary


# ---- tokenizer -----------------------------------------------------------------------------------
def train_tokenizer(docs: list[tuple[str, str]], out: Path):
    """Byte-level BPE over a fixed prefix of the (seeded-shuffled) training docs; saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    sample, size = [], 0
    for _, text in docs:
        if size >= TOKENIZER_SAMPLE_BYTES:
            break
        sample.append(text)
        size += len(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer=trainer)
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    # Like Llama's tokenizers: encoding a text puts BOS in front.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=CONTEXT)
    save_tokenizer(fast, out)
    return load_tokenizer(out)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # Name the class that transformers 4 and 5 both load (5 writes its own new name).
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # The chat template `kiln serve` renders with no --chat-template (ChatML-style turns ending in EOS, tools in
    # Llama's JSON call format), in tokenizer_config.json where transformers 4 and 5 both read it; one copy only.
    config["chat_template"] = CHAT_TEMPLATE.read_text(encoding="utf-8").rstrip("\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")


def encode_stream(tokenizer, docs: list[tuple[str, str]]) -> np.ndarray:
    """All docs as one stream of token ids: BOS doc EOS BOS doc EOS ... (uint16: the vocab is 8192)."""
    backend = tokenizer.backend_tokenizer
    pieces = []
    for i in range(0, len(docs), 2000):  # in slices: Encoding objects of the whole corpus would take GBs
        encodings = backend.encode_batch([text for _, text in docs[i:i + 2000]], add_special_tokens=False)
        pieces.extend(np.asarray([0, *e.ids, 1], dtype=np.uint16) for e in encodings)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


# ---- model and training --------------------------------------------------------------------------
def make_model(preset: Preset):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers, num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        rope_theta=10000.0, attention_bias=False, mlp_bias=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def batch_from(stream: np.ndarray, starts: np.ndarray, device) -> torch.Tensor:
    # -> [B, CONTEXT + 1] int64: inputs are [:, :-1], targets [:, 1:]
    rows = np.stack([stream[s:s + CONTEXT + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows).to(device, non_blocking=True)


def lr_at(step: int, total: int, preset: Preset) -> float:
    if step < preset.warmup_steps:
        return preset.lr * (step + 1) / preset.warmup_steps
    frac = min(1.0, (step - preset.warmup_steps) / max(1, total - preset.warmup_steps))
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def perplexity(model, stream: np.ndarray, num_windows: int, device, rng: np.random.Generator | None) -> float:
    """exp(mean next-token loss) over windows of CONTEXT+1 tokens: consecutive ones, or random (rng)."""
    n = min(num_windows, (len(stream) - 1) // (CONTEXT + 1))
    if rng is None:
        starts = np.arange(n) * (CONTEXT + 1)
    else:
        starts = rng.integers(0, len(stream) - CONTEXT - 1, size=n)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        rows = batch_from(stream, starts[i:i + 16], device)
        logits = model(input_ids=rows[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += rows[:, 1:].numel()
    return math.exp(total / count)


def train(preset: Preset, train_stream: np.ndarray, steps: int | None, device, compile_model: bool) -> dict:
    model = make_model(preset).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"{preset.name}: {params / 1e6:.2f}M parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=preset.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    start = time.perf_counter()
    forward = model
    if compile_model:
        # Compile on a throwaway batch of the real shape; fall back to eager rather than lose the run.
        try:
            compiled = torch.compile(model)
            rows = batch_from(train_stream, np.arange(preset.batch_size), device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                compiled(input_ids=rows[:, :-1]).logits.float().mean().backward()
            opt.zero_grad(set_to_none=True)
            forward = compiled
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: train eagerly
            print(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly", flush=True)
            opt.zero_grad(set_to_none=True)
    rng = np.random.default_rng(SEED)
    use_amp = device.type == "cuda"
    total = steps if steps is not None else 10**9
    measured_at = 30  # after compilation settles, the step time sets the step count for the budget
    step, losses, log = 0, [], []
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, preset)
        rows = batch_from(train_stream, rng.integers(0, len(train_stream) - CONTEXT - 1, size=preset.batch_size),
                          device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = forward(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), rows[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 25 == 0 or step == total:
            losses.append(loss.item())
            elapsed = time.perf_counter() - start
            log.append({"step": step, "loss": round(losses[-1], 4), "elapsed_s": round(elapsed, 1)})
            print(f"step {step}/{total if steps or step > measured_at else '?'} loss {losses[-1]:.3f} "
                  f"{elapsed:.0f}s", flush=True)
        if steps is None and step == measured_at:
            torch.cuda.synchronize() if device.type == "cuda" else None
            t0, s0 = time.perf_counter(), step
        if steps is None and step == measured_at + 20:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t0) / (step - s0)
            remaining = preset.time_budget_s - (time.perf_counter() - start)
            total = step + max(1, int(remaining / per_step * 0.97))
            print(f"{per_step * 1000:.0f} ms/step -> {total} steps in the budget", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.perf_counter() - start
    return {"model": model, "params": params, "steps": total, "train_time_s": round(train_time, 1),
            "tokens_seen": total * preset.batch_size * CONTEXT, "log": log}


# ---- outputs -------------------------------------------------------------------------------------
def write_card(out: Path, record: dict) -> None:
    """The model card, from what training.json records."""
    preset, corpus, ppl = record["preset"], record["corpus"], record["perplexity"]
    role = ("the draft model for speculative decoding with `kiln-tiny-code`" if "draft" in preset["name"]
            else "kiln's default model; `kiln-tiny-code-draft` is its draft for speculative decoding")
    held = ", ".join(f"`{p}`" for p in corpus["held_out_packages"])
    bos, eos, pad = (t.replace("|", "\\|") for t in (BOS, EOS, PAD))  # a bare | splits a table cell
    text = f"""# {preset['name']}

A small Llama-architecture model of Python code, trained by kiln's `scripts/train_tiny.py` for kiln's
examples and tests ({role}). It writes plausible-looking Python; it is not useful for anything else.

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`: hidden {preset['hidden_size']}, {preset['num_hidden_layers']} layers, \
{preset['num_attention_heads']} heads, {preset['num_key_value_heads']} KV heads (GQA), FFN {preset['intermediate_size']}, \
tied embeddings, context {CONTEXT}, rope theta 10000 |
| parameters | {record['params']:,} ({record['params'] / 1e6:.2f}M), stored in bfloat16 |
| tokenizer | byte-level BPE, {VOCAB_SIZE} tokens, trained on the same corpus; `{bos}` = 0 (put in front of \
every encoded text), `{eos}` = 1, `{pad}` = 2 |
| chat template | ChatML-style (`<\\|im_start\\|>role`, each turn ending with `{eos}`) in `tokenizer_config.json` \
(`scripts/tiny_chat_template.jinja`), so `kiln serve` serves chat with no `--chat-template`; tools are shown in \
Llama's call format, `{{"name": ..., "parameters": {{...}}}}`. The model is not trained on chat: it answers in Python |
| data | the `.py` files of Python {corpus['python']}'s standard library and installed site-packages on the \
training machine: {corpus['train_files']:,} files, {corpus['train_bytes'] / 1e6:.0f} MB, \
{corpus['train_tokens'] / 1e6:.1f}M tokens after de-duplication and per-package caps |
| held out | {held} (vendored copies too): {corpus['heldout_files']} files, \
{corpus['heldout_tokens'] / 1e3:.0f}k tokens |
| training | {record['steps']:,} steps of {preset['batch_size']} x {CONTEXT} tokens \
({record['tokens_seen'] / 1e6:.0f}M tokens), AdamW lr {preset['lr']} (warmup {preset['warmup_steps']}, cosine to 10%), \
bf16 autocast, seed {SEED}: {record['train_time_s']:.0f} s on one {record['device_name']}, compilation included |
| perplexity | training {ppl['train']:.2f}, held-out {ppl['heldout']:.2f} (per token; float32 on the bfloat16 \
weights; {CONTEXT}-token windows) |

Reproduce: `{record['command']}` (same seed and steps; the corpus is whatever that machine's Python has).
Training data licences: the Python Software Foundation licence and those of the packages found. The
weights are released with kiln.
"""
    (out / "README.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="reuse this tokenizer instead of training one")
    ap.add_argument("--steps", type=int, help="exact number of steps (default: what fits the time budget)")
    ap.add_argument("--time-budget", type=float, help="seconds for the training loop")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--corpus-bytes", type=int, default=MAX_CORPUS_BYTES, help="smaller for a quick trial")
    args = ap.parse_args()
    preset = PRESETS[args.model]
    if args.time_budget is not None:
        preset = Preset(**{**asdict(preset), "time_budget_s": args.time_budget})
    device = torch.device(args.device)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.backends.cuda.matmul.allow_tf32 = True

    t0 = time.perf_counter()
    train_docs, held_docs, corpus = collect_corpus(args.corpus_bytes)
    random.Random(SEED).shuffle(train_docs)
    random.Random(SEED).shuffle(held_docs)
    print(f"corpus: {json.dumps(corpus)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else train_tokenizer(train_docs, args.out)
    if args.tokenizer:
        save_tokenizer(tokenizer, args.out)
    train_stream = encode_stream(tokenizer, train_docs)
    held_stream = encode_stream(tokenizer, held_docs)
    corpus.update(train_tokens=int(train_stream.size), heldout_tokens=int(held_stream.size))
    print(f"tokens: train {train_stream.size:,}, held-out {held_stream.size:,} "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    stats = train(preset, train_stream, args.steps, device, compile_model=not args.no_compile)
    model = stats.pop("model")
    # Evaluate what ships: bfloat16 weights, computed in float32.
    model = model.to(torch.bfloat16).to(torch.float32).eval()
    stats["perplexity"] = {
        "train": round(perplexity(model, train_stream, args.eval_windows, device, np.random.default_rng(SEED + 1)), 3),
        "heldout": round(perplexity(model, held_stream, args.eval_windows, device, None), 3),
    }
    stats["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    stats["command"] = (f"python scripts/train_tiny.py --model {args.model} --out {preset.name}"
                        + (f" --tokenizer {args.tokenizer.name}" if args.tokenizer else "")
                        + f" --steps {stats['steps']}"
                        + (f" --corpus-bytes {args.corpus_bytes}" if args.corpus_bytes != MAX_CORPUS_BYTES else ""))
    print(f"perplexity: {stats['perplexity']}", flush=True)

    model.to(torch.bfloat16).save_pretrained(args.out)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(args.out)
    record = {"preset": asdict(preset), "corpus": corpus, **stats}
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_card(args.out, record)
    print(f"{preset.name} written to {args.out} ({time.perf_counter() - t0:.0f}s in all)", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()

"""Trains an EAGLE-3 head for the bundled model (`examples/kiln-tiny-code`) on the CPU, written in the published
layout (`LlamaForCausalLMEagle3`) so that kiln reads it exactly as it reads a published head.

The head learns the target's own next-token distributions (distillation: soft cross-entropy against the
target's softmax, which is what acceptance measures), from the target's residual streams entering three layers
(its config's `eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3) as kiln's reader defaults to). The
text is Python source of the standard library and site-packages of this interpreter, without the packages the
bundled model holds out (`train_tiny.HELD_OUT`: json, email, tomllib, requests, click).

Training-time test (EAGLE-3): each window is unrolled `--unroll` steps. Step 1 at chain start p reads token
p + 1 and fc(features at p) and predicts the target's distribution at p + 1; step k > 1 reads token p + k and
the head's own prenorm hidden state of step k - 1, at position p + k - 1, attending to step 1's keys at
positions <= p and to steps 2..k's keys of its own chain, as the proposer's KV cache does when it drafts.

The draft vocabulary is the target's whole vocabulary (8192 tokens: d2t all zero offsets, t2d all true), the
embedding is the target's (the head has none of its own), and lm_head starts from the target's (tied) output
embedding and `norm` from its final norm, both frozen: the head learns to map into the target's output space.

    OMP_NUM_THREADS=1 python scripts/train_eagle3.py --out examples/kiln-tiny-code-eagle3 --time-budget 780

The bundled head was trained on a GPU, on the corpus the target was trained on (`--corpus tiny`: train_tiny's
collection of that machine's Python files), reading layers 2, 4 and 7 (the high layer near the top: the target
has 8) with an MLP 3x the target's (`--intermediate-size`: after the first draft the head reads only its own
hidden state, so it must be a small language model itself):
    python scripts/train_eagle3.py --corpus tiny --device cuda --bf16 --batch-size 128 --seq-len 256 --unroll 5 \
        --feature-layers 2,4,7 --intermediate-size 3072 --time-budget 430 --out HEAD
`--init HEAD` continues training a head (over several GPU sessions); `--dump-stream FILE` / `--stream FILE` encode a
corpus on one machine and train on it on another; `--generated-fraction` mixes in the target's own continuations
(self-distillation; tried: greedy acceptance +0.04, sampled -0.3, so the bundled head does without).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import HELD_OUT, MAX_FILE_BYTES, SKIP_DIRS, collect_corpus, encode_stream, source_roots  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "examples" / "heldout-sample.txt"


# ---- corpus --------------------------------------------------------------------------------------
def sample_corpus(max_bytes: int, seed: int) -> tuple[list[str], dict]:
    """A seeded sample of training files (train_tiny's filters, held-out packages never read) up to max_bytes."""
    files = []
    for root in source_roots():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(p in SKIP_DIRS for p in parts[:-1]) or parts[0] == "kiln":
                continue
            if any(p.removesuffix(".py") in HELD_OUT for p in parts):
                continue
            files.append(path)
    random.Random(seed).shuffle(files)
    texts, total = [], 0
    for path in files:
        try:
            size = path.stat().st_size
            if size == 0 or size > MAX_FILE_BYTES:
                continue
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        total += size
        if total >= max_bytes:
            break
    summary = {"roots": [str(r) for r in source_roots()], "python": sys.version.split()[0],
               "candidate_files": len(files), "train_files": len(texts), "train_bytes": total,
               "held_out_packages": list(HELD_OUT)}
    return texts, summary


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """BOS doc EOS BOS doc EOS ... as one int64 stream."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.asarray([0, *e.ids, 1], dtype=np.int64) for e in encodings])


# ---- the head ------------------------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's rotate_half rope: x [B, heads, S, D], positions [S]."""
    d = x.shape[-1]
    angles = positions[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2, device=x.device).float() / d))  # [S, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class TrainHead(nn.Module):
    """The head's tensors by their published names (`midlayer.*`), and its unrolled training forward."""

    def __init__(self, cfg: dict, embed: torch.Tensor, final_norm: torch.Tensor) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]

        def lin(o, i):
            return nn.Parameter(torch.randn(o, i) * 0.02)

        self.p = nn.ParameterDict({
            "fc": lin(h, 3 * h), "q": lin(self.heads * self.head_dim, 2 * h),
            "k": lin(self.kv_heads * self.head_dim, 2 * h), "v": lin(self.kv_heads * self.head_dim, 2 * h),
            "o": lin(h, self.heads * self.head_dim), "gate": lin(inter, h), "up": lin(inter, h), "down": lin(h, inter),
            "input_ln": nn.Parameter(torch.ones(h)), "hidden_norm": nn.Parameter(torch.ones(h)),
            "post_ln": nn.Parameter(torch.ones(h))})
        self.register_buffer("embed", embed)  # [V, H]: the target's, not trained
        self.register_buffer("norm", final_norm)  # [H]: the target's final norm, frozen
        self.register_buffer("lm_head", embed)  # [V, H]: the target's tied output embedding, frozen

    def forward(self, tokens: list[torch.Tensor], features: torch.Tensor) -> list[torch.Tensor]:
        """tokens: per step k, [B, S] the token it reads; features [B, S, 3H] -> per step, logits [B, S, V]."""
        p = self.p
        b, s, _ = features.shape
        rep = self.heads // self.kv_heads
        hidden = features @ p["fc"].T  # [B, S, H]
        keys, values, out = [], [], []
        for k, tok in enumerate(tokens):
            pos = torch.arange(s, device=features.device) + k  # step k + 1 at chain start p sits at position p + k
            x = torch.cat([rms(self.embed[tok], p["input_ln"], self.eps), rms(hidden, p["hidden_norm"], self.eps)], -1)
            q = rope((x @ p["q"].T).view(b, s, self.heads, -1).transpose(1, 2), pos, self.theta)  # [B, h, S, D]
            kk = rope((x @ p["k"].T).view(b, s, self.kv_heads, -1).transpose(1, 2), pos, self.theta)
            vv = (x @ p["v"].T).view(b, s, self.kv_heads, -1).transpose(1, 2)
            keys.append(kk.repeat_interleave(rep, 1))
            values.append(vv.repeat_interleave(rep, 1))
            scale = self.head_dim ** -0.5
            first = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, S, S]: step 1's keys, causal in chain start
            first = first.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # [B, h, S, 1] each: own chain
            probs = torch.cat([first, *diag], -1).softmax(-1)
            attn = probs[..., :s] @ values[0]
            for j, vj in enumerate(values[1:]):
                attn = attn + probs[..., s + j:s + j + 1] * vj
            residual = attn.transpose(1, 2).reshape(b, s, -1) @ p["o"].T + hidden
            y = rms(residual, p["post_ln"], self.eps)
            prenorm = (F.silu(y @ p["gate"].T) * (y @ p["up"].T)) @ p["down"].T + residual
            out.append(rms(prenorm, self.norm, self.eps) @ self.lm_head.T)
            hidden = prenorm
        return out

    def names(self) -> dict[str, torch.Tensor]:
        """The head's tensors by their published names (trained ones and the frozen norm and lm_head)."""
        p, a, m = self.p, "midlayer.self_attn.", "midlayer.mlp."
        return {"fc.weight": p["fc"], a + "q_proj.weight": p["q"], a + "k_proj.weight": p["k"],
                a + "v_proj.weight": p["v"], a + "o_proj.weight": p["o"], m + "gate_proj.weight": p["gate"],
                m + "up_proj.weight": p["up"], m + "down_proj.weight": p["down"],
                "midlayer.input_layernorm.weight": p["input_ln"], "midlayer.hidden_norm.weight": p["hidden_norm"],
                "midlayer.post_attention_layernorm.weight": p["post_ln"], "norm.weight": self.norm,
                "lm_head.weight": self.lm_head}

    def load_published(self, tensors: dict[str, torch.Tensor]) -> None:
        """Starts from a head written by `published` (`--init`): its trained tensors copied in."""
        with torch.no_grad():
            for name, param in self.names().items():
                if isinstance(param, nn.Parameter):
                    param.copy_(tensors[name].float())

    def published(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors in the published EAGLE-3 layout."""
        vocab = self.embed.shape[0]
        t = self.names()
        out = {k: v.detach().to(dtype).contiguous().clone() for k, v in t.items()}
        out = {k: v.cpu() for k, v in out.items()}
        out["d2t"] = torch.zeros(vocab, dtype=torch.int64)  # draft vocabulary = target vocabulary
        out["t2d"] = torch.ones(vocab, dtype=torch.bool)
        return out


# ---- training ------------------------------------------------------------------------------------
def generate_pool(target, stream: np.ndarray, length: int, prompt_len: int, batch: int, budget_s: float,
                  seed: int, device) -> np.ndarray:
    """Self-distillation text: the target's own continuations of corpus windows (`prompt_len` tokens, then
    `length - prompt_len` generated; batches alternate greedy and temperature-0.8 sampling, which is what
    speculative decoding drafts for), generated for `budget_s` seconds -> [n, length] int64."""
    rng, out, start = np.random.default_rng(seed + 1), [], time.time()
    while time.time() - start < budget_s:
        offsets = rng.integers(0, stream.size - prompt_len, batch)
        prompts = torch.from_numpy(np.stack([stream[o:o + prompt_len] for o in offsets])).to(device)  # [B, P]
        sample = len(out) % 2 == 1
        with torch.no_grad():
            seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=sample,
                                   max_new_tokens=length - prompt_len, min_new_tokens=length - prompt_len,
                                   temperature=0.8 if sample else None, top_p=None, top_k=None, pad_token_id=2)
        out.append(seqs[:, :length].cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, length), dtype=np.int64)


def target_pass(target, window: torch.Tensor, layers: tuple[int, ...], s: int):
    """window [B, S + U] -> (features [B, S, 3H] at chain starts 0..S-1, target probabilities [B, S + U, V])."""
    with torch.no_grad():
        out = target(window, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i][:, :s] for i in layers], -1)
        return feats, out.logits.float().softmax(-1)


def step_inputs(window: torch.Tensor, probs: torch.Tensor, s: int, unroll: int):
    """Per step k (0-based): the tokens read at chain starts 0..S-1 (window[p + k + 1]) and the target
    distributions to match there (at p + k + 1)."""
    return ([window[:, k + 1:k + 1 + s] for k in range(unroll)], [probs[:, k + 1:k + 1 + s] for k in range(unroll)])


def evaluate(head, target, stream: np.ndarray, layers, s: int, unroll: int, windows: int, device) -> list[float]:
    """Top-1 agreement with the target's argmax per unrolled step over the first `windows` windows of `stream`."""
    hits, n = [0.0] * unroll, 0
    with torch.no_grad():
        for i in range(windows):
            w = torch.from_numpy(stream[i * (s + unroll):(i + 1) * (s + unroll)].astype(np.int64))[None].to(device)
            if w.shape[1] < s + unroll:
                break
            feats, probs = target_pass(target, w, layers, s)
            toks, goals = step_inputs(w, probs, s - 1, unroll)  # the last chain start has no step-3 target
            logits = head(toks, feats[:, :s - 1])
            for k in range(unroll):
                hits[k] += float((logits[k].argmax(-1) == goals[k].argmax(-1)).float().sum())
            n += s - 1
    return [round(h / max(n, 1), 4) for h in hits]


def head_config(target_cfg: dict, layers: tuple[int, ...]) -> dict:
    """The head's config.json: one Llama decoder layer of the target's width, the target's vocabulary."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "bos_token_id", "eos_token_id")
    cfg = {k: target_cfg[k] for k in keys}
    theta = (target_cfg.get("rope_parameters") or {}).get("rope_theta", target_cfg.get("rope_theta", 10000.0))
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1, rope_theta=theta,
               draft_vocab_size=target_cfg["vocab_size"], target_hidden_size=target_cfg["hidden_size"],
               eagle_aux_hidden_state_layer_ids=list(layers), tie_word_embeddings=False, torch_dtype="bfloat16")
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "examples" / "kiln-tiny-code"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-budget", type=float, default=780.0, help="seconds of training (evaluation excluded)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--unroll", type=int, default=3, help="training-time test steps")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--corpus-bytes", type=int, default=12_000_000)
    ap.add_argument("--corpus", choices=("sample", "tiny"), default="sample",
                    help="sample: a seeded sample of --corpus-bytes of this interpreter's Python files; tiny: the "
                         "whole corpus scripts/train_tiny.py trains the bundled models on (de-duplicated, "
                         "per-package caps), which on the machine they were trained on is their own training text")
    ap.add_argument("--feature-layers", default=None, metavar="I,J,K",
                    help="the target layers whose input residual streams the head reads (default: the target "
                         "config's eagle_aux_hidden_state_layer_ids, else 2, L // 2, L - 3); below L, since the "
                         "last entry of transformers' hidden states has the final norm applied")
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="the head's MLP width (default: the target's); its later draft steps read only its own "
                         "hidden state, so a wider MLP is where a head gains as a language model of its own")
    ap.add_argument("--init", default=None, metavar="HEAD_DIR",
                    help="continue training a head this script wrote (its config and weights; the optimizer and "
                         "the learning-rate schedule start afresh), e.g. over several GPU sessions")
    ap.add_argument("--bf16", action="store_true", help="autocast matmuls to bfloat16 (CUDA), losses in float32")
    ap.add_argument("--generated-fraction", type=float, default=0.0,
                    help="share of each batch taken from the target's own continuations (generate_pool)")
    ap.add_argument("--generate-budget", type=float, default=120.0, help="seconds spent generating them")
    ap.add_argument("--generate-batch", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--stream", default=None, help="a token stream written by --dump-stream (instead of this machine's corpus)")
    ap.add_argument("--dump-stream", default=None, metavar="FILE.npy", help="encode the corpus, write it and stop")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer, LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().to(device)
    target.requires_grad_(False)
    tcfg = json.loads((Path(args.target) / "config.json").read_text())
    n_layers = tcfg["num_hidden_layers"]
    layers = tuple(tcfg.get("eagle_aux_hidden_state_layer_ids") or (2, n_layers // 2, n_layers - 3))
    if args.feature_layers:
        layers = tuple(int(i) for i in args.feature_layers.split(","))
        if len(layers) != 3 or not all(0 <= i < n_layers for i in layers):
            ap.error(f"--feature-layers {args.feature_layers}: three layer indices in [0, {n_layers})")
    cfg = head_config(tcfg, layers)
    if args.intermediate_size:
        cfg["intermediate_size"] = args.intermediate_size
    if args.init:  # continue training a head: its shape and feature layers are the head's own
        cfg = json.loads((Path(args.init) / "config.json").read_text())
        layers = tuple(cfg["eagle_aux_hidden_state_layer_ids"])
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    t0 = time.time()
    if args.stream:
        stream = np.load(args.stream).astype(np.int64)
        corpus = json.loads(Path(args.stream).with_suffix(".json").read_text())
    elif args.corpus == "tiny":
        docs, _, corpus = collect_corpus()
        stream = encode_stream(tokenizer, docs).astype(np.int64)
    else:
        texts, corpus = sample_corpus(args.corpus_bytes, args.seed)
        stream = encode(tokenizer, texts)
    if args.dump_stream:  # vocabulary 8192 fits uint16
        np.save(args.dump_stream, stream.astype(np.uint16))
        Path(args.dump_stream).with_suffix(".json").write_text(json.dumps(corpus) + "\n")
        print(f"wrote {args.dump_stream}: {stream.size:,} tokens")
        return
    heldout = np.asarray(tokenizer.backend_tokenizer.encode(HELDOUT.read_text(), add_special_tokens=False).ids)
    corpus.update(train_tokens=int(stream.size), prepare_s=round(time.time() - t0, 1))
    pool = np.zeros((0, args.seq_len + args.unroll), dtype=np.int64)
    if args.generated_fraction > 0:
        t1 = time.time()
        pool = generate_pool(target, stream, args.seq_len + args.unroll, 64, args.generate_batch,
                             args.generate_budget, args.seed, device)
        corpus.update(generated_sequences=len(pool), generated_tokens=int(pool.size),
                      generated_prompt_tokens=64, generate_s=round(time.time() - t1, 1),
                      generated_fraction=args.generated_fraction)
        print(f"generated {len(pool)} sequences of {pool.shape[1]} tokens in {corpus['generate_s']}s", flush=True)
    print(f"corpus: {corpus['train_files']} files, {stream.size:,} tokens in {corpus['prepare_s']}s", flush=True)

    head = TrainHead(cfg, target.model.embed_tokens.weight.detach(), target.model.norm.weight.detach()).to(device)
    if args.init:
        from safetensors.torch import load_file
        head.load_published(load_file(str(Path(args.init) / "model.safetensors")))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    s, u = args.seq_len, args.unroll
    weights = [0.8 ** k for k in range(u)]  # EAGLE-3's decay over the unrolled steps
    log, step, start, est_steps = [], 0, time.time(), None
    while time.time() - start < args.time_budget:
        n_gen = round(args.batch_size * args.generated_fraction) if len(pool) else 0
        offsets = rng.integers(0, stream.size - s - u, args.batch_size - n_gen)
        rows = [stream[o:o + s + u] for o in offsets] + list(pool[rng.integers(0, len(pool), n_gen)])
        window = torch.from_numpy(np.stack(rows)).to(device)  # [B, S + U]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            feats, probs = target_pass(target, window, layers, s)
            toks, goals = step_inputs(window, probs, s, u)
            logits = head(toks, feats)
        losses = [F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), g.float().reshape(-1, g.shape[-1]))
                  for lg, g in zip(logits, goals)]
        loss = sum(w * loss_k for w, loss_k in zip(weights, losses))
        elapsed = time.time() - start
        if est_steps is None and step == 2:  # schedule the cosine over the steps the budget will hold
            est_steps = max(int(args.time_budget / (elapsed / 3)), args.warmup + 1)
        total = est_steps or 10_000
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))
        for group in opt.param_groups:
            group["lr"] = max(lr, args.lr * 0.02)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            top1 = [round(float((lg.argmax(-1) == g.argmax(-1)).float().mean()), 3) for lg, g in zip(logits, goals)]
            entry = {"step": step, "loss": round(float(loss.detach()), 4), "loss_per_step": [round(float(x.detach()), 4) for x in losses],
                     "top1_per_step": top1, "elapsed_s": round(time.time() - start, 1)}
            log.append(entry)
            print(entry, flush=True)
    train_s = round(time.time() - start, 1)
    held = evaluate(head, target, heldout, layers, s, u, windows=12, device=device)
    print(f"held-out top-1 agreement with the target per step: {held}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = head.published(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    trainable = sum(p.numel() for p in params)
    record = {
        "preset": {"name": out.name, "target": Path(args.target).name, "hidden_size": cfg["hidden_size"],
                   "intermediate_size": cfg["intermediate_size"], "feature_layers": list(layers),
                   "draft_vocab_size": cfg["draft_vocab_size"], "seq_len": s, "batch_size": args.batch_size,
                   "unroll": u, "step_weights": weights, "lr": args.lr, "bf16_autocast": args.bf16, "warmup_steps": args.warmup,
                   "time_budget_s": args.time_budget, "seed": args.seed, "init": args.init, "threads": args.threads,
                   "loss": "soft cross-entropy against the target's next-token distribution (distillation)",
                   "frozen": "lm_head (the target's tied embedding), norm (the target's final norm), embedding"},
        "corpus": corpus, "trainable_params": trainable, "steps": step, "train_time_s": train_s,
        "tokens_seen": step * args.batch_size * s, "log": log,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({args.threads} thread(s))",
        "heldout_top1_per_step": held,
        "command": ("OMP_NUM_THREADS=1 " if device.type == "cpu" else "") + "python scripts/train_eagle3.py "
                   + " ".join(sys.argv[1:]),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()

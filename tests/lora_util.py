"""Real PEFT LoRA adapters for the tests (the `peft` package): random lora_B (`make_adapter`), or a short
fine-tune on a slice of code (`train_adapter`), so an adapter changes the output."""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path

import torch

# (base model, text, steps, LoRA config) -> the adapter directory first trained for it in this test session
_TRAINED: dict[tuple, Path] = {}


def make_adapter(base, out: Path, seed: int = 0, safe: bool = True, **lora):
    """A PEFT adapter over a copy of `base` with random lora_B, saved to `out`; returns (out, PeftModel)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    model.save_pretrained(out, safe_serialization=safe)
    return out, model


def train_adapter(base, out: Path, text: str, steps: int = 24, *, seed: int = 0, lr: float = 5e-3,
                  seq_len: int = 64, batch: int = 2, **lora) -> Path:
    """A PEFT LoRA (`lora`: LoraConfig's fields) fine-tuned on `text` for `steps` AdamW steps over a float32 copy
    of `base` (a transformers causal LM loaded from a directory with its tokenizer), on random windows of
    `seq_len` tokens, `batch` a step; saved to `out`. The defaults take about 3 s on 2 CPU cores for the bundled
    kiln-tiny-code and change its greedy output. Cached per test session: the same arguments again copy the
    first result to `out` instead of training."""
    import peft
    import transformers

    key = (base.config.name_or_path, hashlib.sha256(text.encode()).hexdigest(), steps, seed, lr, seq_len, batch,
           repr(sorted(lora.items())))
    if key in _TRAINED:
        if Path(out) != _TRAINED[key]:
            shutil.copytree(_TRAINED[key], out, dirs_exist_ok=True)
        return Path(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base.config.name_or_path)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    if len(ids) <= seq_len:
        raise ValueError(f"text of {len(ids)} tokens is too short for seq_len={seq_len}")
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base).float(), peft.LoraConfig(**lora))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch,)).tolist()
        window = torch.stack([ids[s:s + seq_len] for s in starts])
        loss = model(input_ids=window, labels=window).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    _TRAINED[key] = Path(out)
    return Path(out)


def peft_greedy(base, dirs: dict[int, Path], prompts, tokenizer, max_tokens: int) -> dict:
    """PEFT's greedy generation in float32: {(prompt index, adapter id): (token ids, logprobs)}, id 0 the base
    model and each other id the adapter in dirs[id]; exactly max_tokens tokens (EOS masked). Asserts every
    adapter changes some output, else comparing with it proves nothing."""
    import peft

    expected = {}
    for lora_id in (0, *dirs):
        model = base if lora_id == 0 else peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs[lora_id]).eval()
        for p, prompt in enumerate(prompts):
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            # raw logits: min_new_tokens masks EOS in the scores
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
            expected[p, lora_id] = (tokens, logprobs)
    for lora_id in dirs:
        assert any(expected[p, lora_id][0] != expected[p, 0][0] for p in range(len(prompts))), lora_id
    return expected

"""What `add_request` checks before anything is allocated: the prompt's tokens and that the request fits."""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int) -> list[int]:
    """A prompt's token ids (a string is encoded with `tokenizer`), each checked against the vocabulary; a
    ValueError names the problem."""
    if isinstance(prompt, str):
        if prompt == "":
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer (none was in the checkpoint): pass token ids")
        token_ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, Sequence):
        token_ids = list(prompt)
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt is empty")
    # The common case checked by C-level builtins: a Python loop over the ids holds the GIL (half a second a
    # million ids), stalling whichever thread shares it. The loop below only finds what is wrong.
    if set(map(type, token_ids)) == {int} and 0 <= min(token_ids) and max(token_ids) < vocab_size:
        return token_ids
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab_size})")
    return token_ids


def check_fits(num_prompt_tokens: int, params: SamplingParams, max_seq_len: int, blocks: BlockManager) -> None:
    """Raises ValueError when prompt + max_tokens exceeds max_seq_len or could never fit in the KV cache."""
    total = num_prompt_tokens + params.max_tokens
    if total > max_seq_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"max_seq_len {max_seq_len}"
        )
    beams = max(1, params.beam_width)  # beams may each need blocks of their own
    needed = blocks.blocks_needed(total) * beams
    if needed > blocks.num_blocks:
        of = f" x {beams} beams" if beams > 1 else ""
        raise ValueError(
            f"prompt + max_tokens = {total} tokens{of} needs {needed} KV blocks but the cache has only "
            f"{blocks.num_blocks}; lower max_tokens{' or n' if beams > 1 else ''} or give the cache more blocks"
        )

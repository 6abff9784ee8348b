"""Bounds on an engine's build limits: one check for `kiln build`'s flags (before anything is built) and
engine.json's build_config (before anything is loaded).

The runtime sizes buffers by these numbers (the rope table by max_seq_len, the CUDA graphs' block tables by
max_batch_size x blocks per sequence, activations by max_num_tokens), so an absurd value from a damaged or
hostile engine.json must fail in one line naming the key, the value and the limit instead of allocating
gigabytes first. The limits are far above any real deployment; raise one here, with its reason, if not.
"""

from __future__ import annotations

from typing import Any

MAX_BATCH_SIZE = 1 << 16  # requests per step; real deployments run at most a few thousand
MAX_NUM_TOKENS = 1 << 20  # tokens per step; real deployments use 2048-65536
# Rope positions are float32 (model_defs/layers/rotary.py), exact integers only up to 2**24; the longest
# context of a released model is 10485760 tokens (Llama 4 Scout).
MAX_SEQ_LEN = 1 << 24
MAX_KV_BLOCK_SIZE = 256
# Beams per request (beam search); TensorRT-LLM's kernels go to 1024, real use stays below 16.
MAX_BEAM_WIDTH = 1024  # tokens per KV-cache block, a power of two
# Block-table entries of a full batch (max_batch_size x blocks per sequence): the CUDA graphs hold several
# int32 tables of this size (512 MiB each at the limit). 2048 requests of 128K tokens in blocks of 16 are 2**24.
MAX_BLOCK_TABLE_ENTRIES = 1 << 27


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_build_limits(*, max_batch_size: Any, max_num_tokens: Any, max_seq_len: Any, kv_block_size: Any) -> None:
    """Raises ValueError naming the first of the four that is not a positive integer within its limit, a
    kv_block_size that is not a power of two, or a batch whose block tables would be too large. `max_seq_len`
    None (not yet resolved from the model) skips the checks that need it."""
    values = {"max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens, "max_seq_len": max_seq_len,
              "kv_block_size": kv_block_size}
    limits = {"max_batch_size": MAX_BATCH_SIZE, "max_num_tokens": MAX_NUM_TOKENS, "max_seq_len": MAX_SEQ_LEN,
              "kv_block_size": MAX_KV_BLOCK_SIZE}
    for name, value in values.items():
        if value is None and name == "max_seq_len":
            continue
        if not _is_count(value) or value < 1:
            raise ValueError(f"{name}={value!r:.80} must be a positive integer")
        if value > limits[name]:
            raise ValueError(f"{name}={value} exceeds kiln's limit {limits[name]}")
    if kv_block_size & (kv_block_size - 1):
        raise ValueError(f"kv_block_size={kv_block_size} must be a power of two up to {MAX_KV_BLOCK_SIZE}")
    if max_seq_len is None:
        return
    entries = max_batch_size * -(-max_seq_len // kv_block_size)
    if entries > MAX_BLOCK_TABLE_ENTRIES:
        raise ValueError(f"max_batch_size={max_batch_size} x max_seq_len={max_seq_len} / kv_block_size="
                         f"{kv_block_size} is {entries} KV-block-table entries, over kiln's limit "
                         f"{MAX_BLOCK_TABLE_ENTRIES}: lower max_batch_size or max_seq_len, or raise kv_block_size")


def check_max_beam_width(value: Any) -> None:
    """Raises ValueError unless `value` (max_beam_width) is an integer in [1, MAX_BEAM_WIDTH]."""
    if not _is_count(value) or not 1 <= value <= MAX_BEAM_WIDTH:
        raise ValueError(f"max_beam_width={value!r} must be an integer in [1, {MAX_BEAM_WIDTH}]")

"""The prefix cache's content hashes (plain Python, no torch): a block's hash chains every token before it.

A chain starts from what a block's contents depend on besides its tokens: nothing for the base model, the LoRA
adapter otherwise (two adapters' KV differ for the same tokens), and a `salt` where the cache holds something
else than the target's KV (an EAGLE-3 head's positions read the token after theirs and the target's features
of everything before: speculative/eagle3.py salts with the request's first token).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def first_parent(lora_int_id: int, salt: bytes = b"") -> bytes | None:
    """The chain's start: None for the base model without salt."""
    start = b"lora:%d" % lora_int_id if lora_int_id else b""
    if salt:
        start += b"salt:" + salt
    return start or None


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The hash of a block of `tokens` after the block whose hash is `parent` (None: the first block)."""
    # sha256 rather than Python's hash(): a collision would silently serve another prompt's KV.
    h = hashlib.sha256(parent or b"")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()

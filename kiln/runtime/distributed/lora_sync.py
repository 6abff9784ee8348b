"""LoRA adapters on every rank of a tensor-parallel engine: the `lora` messages and the agreement around them.

Steps carry only adapter ids (`step_codec`'s `lora` column); every rank must hold each id a step names, as
its own slice of the adapter (`LoRASlots` shards by the rank's mapping: column-parallel layers take B's rows,
row-parallel ones A's columns). Rank 0 decides what the ranks hold, with two messages of their own between
steps (checked JSON like every message on the step channel):

- `lora` (`encode_lora`): the first time a request names an adapter the other ranks do not hold, its
  `LoRARequest` (name, id, path). Rank 0 keeps the adapter first (a refusal there sends nothing); then every
  other rank reads it itself and the ranks compare outcomes (`RankGroups.gather_texts`). One that any rank
  refused is dropped by the ranks that took it, and rank 0 raises a ValueError naming the refusing ranks and
  why; the engine goes on. So an id is held by every rank or by none.
- `lora_drop` (`encode_drop`): adapters rank 0 evicted from its host memory (never one a live request uses:
  rank 0 pins those, `LoRASlots.pin`), which the other ranks forget too. They pin whatever they hold, so they
  never evict, nor read from disk during a step, on their own: their host memory follows rank 0's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from kiln.checkpoints.lora_adapter import LoRAAdapter
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.distributed.wire_checks import (
    FORMAT_VERSION,
    StepCodecError,
    check_keys,
    int_list,
    int_value,
)
from kiln.runtime.worker.lora_slots import LoRASlots

INT32_END = 2 ** 31  # as step_codec's: the ids ride the step's int32-checked `lora` column
_LORA_KEYS = frozenset({"kind", "v", "name", "id", "path"})
_DROP_KEYS = frozenset({"kind", "v", "ids"})
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode


@dataclass(frozen=True)
class LoRADrop:
    """The adapters (by id) rank 0 no longer holds: the other ranks forget them."""

    ids: tuple[int, ...]


def encode_lora(request: LoRARequest) -> bytes:
    """The `lora` message: the adapter every other rank is to read and hold."""
    return _DUMPS({"kind": "lora", "v": FORMAT_VERSION, "name": request.lora_name, "id": request.lora_int_id,
                   "path": request.lora_path}).encode()


def encode_drop(ids: list[int]) -> bytes:
    """The `lora_drop` message: adapters the other ranks are to forget."""
    return _DUMPS({"kind": "lora_drop", "v": FORMAT_VERSION, "ids": sorted(ids)}).encode()


def decode_lora(message: dict) -> LoRARequest | LoRADrop:
    """A loaded `lora` or `lora_drop` message (its version already checked) as a LoRARequest or LoRADrop;
    StepCodecError naming the field for anything else."""
    if message.get("kind") == "lora_drop":
        check_keys(message, _DROP_KEYS, "lora_drop message")
        return LoRADrop(tuple(int_list(message, "ids", 1, INT32_END, None)))
    check_keys(message, _LORA_KEYS, "lora message")
    lora_id = int_value(message["id"], 1, INT32_END, "lora message field 'id'")
    for name in ("name", "path"):
        if type(message[name]) is not str or not message[name]:
            raise StepCodecError(f"lora message field {name!r} must be a non-empty string")
    return LoRARequest(message["name"], lora_id, message["path"])


# ---- the other ranks ---------------------------------------------------------------------------------
def apply_on_worker(slots: LoRASlots | None, message: LoRARequest | LoRADrop,
                    gather: Callable[[str], list[str]]) -> None:
    """What ranks 1.. do with a `lora` message (read and hold the adapter, tell rank 0 how it went through
    `gather`, `RankGroups.gather_texts`) or a `lora_drop` message. A refusal is rank 0's to report: the rank
    goes on."""
    if isinstance(message, LoRADrop):
        for lora_int_id in message.ids:
            slots.discard(lora_int_id)
        return
    error = _register(slots, message, None)
    refused = any(gather(error))
    if not error:
        if refused:  # another rank refused it: held by none (this rank did not hold it before: module docstring)
            slots.discard(message.lora_int_id)
        else:  # held until rank 0 drops it
            slots.pin(message.lora_int_id)


def _register(slots: LoRASlots | None, request: LoRARequest, adapter: LoRAAdapter | None) -> str:
    """`slots.register`, its failure as text ("" when it succeeded)."""
    try:
        if slots is None:
            raise ValueError("this rank was started without enable_lora")
        slots.register(request, adapter)
    except ValueError as e:  # LoRAError included: what the user gets to read
        return str(e) or type(e).__name__
    except Exception as e:  # anything else a read may raise (OSError, ...): refused all the same, named
        return f"{type(e).__name__}: {e}"
    return ""


# ---- rank 0 ------------------------------------------------------------------------------------------
class RankZeroLoRA:
    """Rank 0's side: keeps the other ranks' adapters in step with rank 0's `slots`. `send` puts a message on
    the step channel (after the ones before it), `gather` is `RankGroups.gather_texts`."""

    def __init__(self, slots: LoRASlots, send: Callable[[bytes], None], gather: Callable[[str], list[str]]) -> None:
        self.slots = slots
        self.send, self.gather = send, gather
        self.held: set[int] = set()  # ids every other rank holds

    def add(self, request: LoRARequest, adapter: LoRAAdapter | None) -> None:
        """Rank 0 keeps the adapter (`adapter`, already read, or read here: `LoRASlots.register`), then the
        others read it unless they hold it; a ValueError when any rank refused it (held by none then)."""
        lora_int_id = request.lora_int_id
        new = not self.slots.knows(lora_int_id)
        self.slots.register(request, adapter)  # rank 0's refusal: nothing sent
        if lora_int_id not in self.held:
            self.send(encode_lora(request))
            refusals = [(rank, text) for rank, text in enumerate(self.gather("")) if text]
            if refusals:
                if new:
                    self.slots.discard(lora_int_id)
                raise refusal_error(refusals)
            self.held.add(lora_int_id)
        self.sync_drops()  # keeping it may have evicted another from rank 0's host memory

    def sync_drops(self) -> None:
        """Tells the other ranks to forget the adapters rank 0 no longer holds in host memory."""
        gone = [i for i in self.held if not self.slots.holds(i)]
        if gone:
            self.held.difference_update(gone)
            self.send(encode_drop(gone))


def refusal_error(refusals: list[tuple[int, str]]) -> ValueError:
    """The ValueError for an adapter some ranks refused, naming each with its reason (the same reason once)."""
    reasons: dict[str, list[int]] = {}
    for rank, text in refusals:
        reasons.setdefault(text, []).append(rank)
    return ValueError("; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
                                for text, ranks in reasons.items()))

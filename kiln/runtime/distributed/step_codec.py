"""What crosses the step channel, as plain data with a schema: JSON, never pickle.

Rank 0 sends the other ranks two kinds of message: once, a worker's start arguments (`encode_start`: the engine
directory, its `RuntimeConfig`, its `RankLaunch`, the KV-cache scales and the log level), then one `StepInput`
per step and a stop (`StepEncoder.encode(None)`); between steps, the LoRA adapters the ranks are to hold
(`lora_sync.py`). A pickle runs whatever code its bytes name, so a rank that
unpickled what reached it from a pipe or a socket would run whatever a writer to it chose; here every message is
JSON that the decoder checks field by field (names, types, ranges, lengths) and rejects with a `StepCodecError`
naming the field, anything else included.

A step is columns, not one object per request: `ids`, `ntok` (tokens per request), `tokens` (all requests'
tokens, concatenated), `start`, `nprompt`, `nsampled`, `stamp` (the `BlockTable` stamp, 0 for a table without
one), `nblk` (the table's length), `have` (how many of its blocks the ranks hold already), `blocks` (each table's
blocks from `have` on, concatenated), `preempted`, `copies` (beam search's (src, dst) block pairs, flat), `kv`
(the host tier's `KVTransfers`, null for none), and `targets` ([request id, prompt token ids, top_k, logprobs,
logits] per prompt-logprob or context-logits target). Flat integer lists are what `json` encodes and decodes
fastest, and what the decoder checks in C (`set(map(type, ...))`, `min`, `max`) rather than element by element in
Python.

Block tables travel as what they gained: a stamped table only grows (`block_table.py`), so the encoder and every
decoder keep the same ledger (stamp -> blocks sent), and a decode step sends a block only every `block_size`
tokens instead of every request's whole table every step. Both ledgers see the same messages in the same order
and forget a stamp by the same rule (unused for `LEDGER_STEPS` steps), so they agree without talking; a stamp
the ranks have forgotten is sent whole again (`have` 0), and a decoder whose ledger disagrees with `have`
refuses the step.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.runtime.core.block_table import BlockTable
from kiln.runtime.core.kv_tiers import NO_TRANSFERS, KVTransfers
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.distributed.launch import RankLaunch
from kiln.runtime.distributed.lora_sync import LoRADrop, decode_lora
from kiln.runtime.distributed.wire_checks import (
    FORMAT_VERSION,
    StepCodecError,
    check_keys,
    float_value,
    int_list,
    int_tuple,
    int_value,
    load_message,
    str_list,
    where_greater,
)
from kiln.runtime.sampling.prompt_logprobs import PromptLogprobTarget
from kiln.runtime.worker.engine_loader import RuntimeConfig
from kiln.runtime.worker.model_step import StepInput

INT32_END = 2 ** 31  # token ids, block ids, positions and counts are below this (the runner packs them as int32)
INT64_END = 2 ** 63  # block-table stamps
# A stamp no step has used for this many steps is forgotten by encoder and decoders alike (the requests that
# run are scheduled every step; one that sat out longer gets its table sent whole again).
LEDGER_STEPS = 32
_STEP_KEYS = frozenset({"kind", "v", "ids", "ntok", "tokens", "start", "nprompt", "nsampled", "stamp", "nblk",
                        "have", "blocks", "preempted", "targets", "lora", "copies", "kv", "ropemin"})
_STOP_KEYS = frozenset({"kind", "v"})
_START_KEYS = frozenset({"kind", "v", "engine_dir", "runtime", "launch", "kv_cache_scales", "log_level"})
# The wire form of each RuntimeConfig / RankLaunch field; a field added there without one here is refused by
# the encoder (a test checks the sets agree), so a new setting cannot silently stay behind on rank 0.
_RUNTIME_FIELDS = {"device": "device", "dtype": "dtype", "max_batch_size": "int", "max_num_tokens": "int",
                   "max_seq_len": "int", "block_size": "int", "num_kv_blocks": "int?",
                   "enable_prefix_caching": "bool", "kv_cache_memory_fraction": "float", "cuda_graphs": "bool",
                   "kv_cache_dtype": "dtype?", "async_scheduling": "bool?",
                   "capacity_scheduler_policy": "str", "enable_lora": "bool", "max_loras": "int", "max_lora_rank": "int",
                   "max_cpu_loras": "int", "kv_offloading_size": "float", "kv_offloading_dir": "str?",
                   "kv_offloading_disk_size": "float", "verify_tokens": "int", "verify_tree": "bool", "feature_layers": "ints"}
_LAUNCH_FIELDS = {"rank": "int", "world_size": "int", "master_addr": "str", "master_port": "int",
                  "local_rank": "int", "local_world_size": "int", "external": "bool"}
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode
STOP = _DUMPS({"kind": "stop", "v": FORMAT_VERSION}).encode()


class _Ledger:
    """stamp -> what the ranks hold of that table, least recently used first; forgets by `LEDGER_STEPS`."""

    def __init__(self) -> None:
        self.tables: OrderedDict[int, Any] = OrderedDict()  # stamp -> [value, step that last used it]
        self.step = 0

    def use(self, stamp: int, value: Any) -> None:
        entry = self.tables.get(stamp)
        if entry is None:
            self.tables[stamp] = [value, self.step]
        else:
            entry[0], entry[1] = value, self.step
            self.tables.move_to_end(stamp)

    def end_step(self) -> None:
        oldest = self.step - LEDGER_STEPS
        tables = self.tables
        while tables:
            stamp, (_, used) = next(iter(tables.items()))
            if used > oldest:
                break
            del tables[stamp]
        self.step += 1


# ---- steps ---------------------------------------------------------------------------------------
class StepEncoder:
    """Rank 0's end: one per engine, its messages sent to every other rank in order (each decoder's ledger
    follows this one's)."""

    def __init__(self) -> None:
        self._ledger = _Ledger()  # stamp -> blocks the ranks hold

    def encode(self, step: StepInput | None) -> bytes:
        """The step as JSON bytes; None (stop the ranks) as a stop message. A `TokenFeed` (tokens still on rank
        0's device) cannot be sent: a StepCodecError. The ledger changes only once the message is made."""
        if step is None:
            return STOP
        if step.token_feed is not None:
            raise StepCodecError("a step with a TokenFeed cannot be sent to other ranks: its tokens are on rank "
                                 "0's device (a tensor-parallel executor does not accept token feeds)")
        requests = step.schedule.requests
        ids, ntok, tokens, start, nprompt, nsampled, stamps, nblk, have, blocks, lora, ropemin = ([] for _ in range(12))
        held = self._ledger.tables
        sent: dict[int, int] = {}  # this step's ledger updates, applied once the message is made
        for r in requests:
            if r.draft_parents:  # tree drafts come from an EAGLE-3 head, which runs with one rank only
                raise StepCodecError(f"request {r.request_id!r} verifies tree drafts, which other ranks cannot run")
            ids.append(r.request_id)
            ntok.append(len(r.token_ids))
            tokens += r.token_ids
            start.append(r.start_position)
            nprompt.append(r.num_prompt_tokens)
            nsampled.append(r.num_sampled)
            lora.append(r.lora_int_id)
            ropemin.append(r.rope_min_length)
            table = r.block_ids
            n = len(table)
            stamp = table.stamp if isinstance(table, BlockTable) else 0
            if stamp:
                known = sent.get(stamp)
                if known is None:
                    entry = held.get(stamp)
                    known = 0 if entry is None else entry[0]
                if known > n:  # cannot happen to one stamp's list; sent whole rather than trusted
                    known = 0
                blocks += table.since(known)  # a slice of its list: only what the ranks lack
                sent[stamp] = n
            else:
                known = 0
                blocks += table
            stamps.append(stamp)
            nblk.append(n)
            have.append(known)
        targets = [[rid, list(t.token_ids), t.top_k, t.logprobs, t.logits]
                   for rid, t in step.prompt_logprob_targets.items()]
        try:
            data = _DUMPS({"kind": "step", "v": FORMAT_VERSION, "ids": ids, "ntok": ntok, "tokens": tokens,
                           "start": start, "nprompt": nprompt, "nsampled": nsampled, "stamp": stamps, "nblk": nblk,
                           "have": have, "blocks": blocks, "preempted": list(step.schedule.preempted_ids),
                           "targets": targets, "lora": lora, "ropemin": ropemin,
                           "copies": [b for pair in step.schedule.block_copies for b in pair],
                           "kv": _encode_transfers(step.schedule.kv_transfers)}).encode()
        except (TypeError, ValueError) as e:  # e.g. a numpy integer among the token ids
            raise StepCodecError(f"step has a value with no JSON form: {e}") from None
        for stamp, n in sent.items():
            self._ledger.use(stamp, n)
        self._ledger.end_step()
        return data


class StepDecoder:
    """A worker's end: decodes rank 0's messages in the order they were sent."""

    def __init__(self) -> None:
        self._ledger = _Ledger()  # stamp -> the table's block list (append-only, shared by its BlockTables)

    def decode(self, data: bytes) -> StepInput | LoRARequest | LoRADrop | None:
        """The `StepInput` that `StepEncoder.encode` made (None: stop; a LoRARequest or LoRADrop: `lora_sync`'s
        messages, an adapter to hold or ones to forget). StepCodecError for anything else: not
        JSON, a missing or unknown field, a value of the wrong type or out of range, columns of different
        lengths, a block table that does not continue what this rank holds. A decoder that raised may hold part
        of the failed step: a worker ends at its first error."""
        message = load_message(data, "step")
        kind = message.get("kind")
        if kind == "stop":
            check_keys(message, _STOP_KEYS, "stop message")
            return None
        if kind in ("lora", "lora_drop"):
            return decode_lora(message)
        if kind != "step":
            raise StepCodecError(f"step channel: unknown message kind {kind!r} (expected 'step', 'lora', "
                                 f"'lora_drop' or 'stop')")
        check_keys(message, _STEP_KEYS, "step")
        ids = str_list(message, "ids")
        n = len(ids)
        ntok = int_list(message, "ntok", 1, INT32_END, n)
        start = int_list(message, "start", 0, INT32_END, n)
        nprompt = int_list(message, "nprompt", 0, INT32_END, n)
        nsampled = int_list(message, "nsampled", 0, INT32_END, n)
        lora = int_list(message, "lora", 0, INT32_END, n)
        ropemin = int_list(message, "ropemin", 0, INT32_END, n)
        stamps = int_list(message, "stamp", 0, INT64_END, n)
        nblk = int_list(message, "nblk", 0, INT32_END, n)
        have = int_list(message, "have", 0, INT32_END, n)
        for i in where_greater(have, nblk):
            raise StepCodecError(f"step field 'have'[{i}]={have[i]} exceeds the table's {nblk[i]} blocks "
                                 f"('nblk'[{i}])")
        for i in where_greater(nsampled, ntok):
            raise StepCodecError(f"step field 'nsampled'[{i}]={nsampled[i]} exceeds the request's {ntok[i]} "
                                 f"tokens ('ntok'[{i}])")
        tokens = int_list(message, "tokens", 0, INT32_END, sum(ntok))
        blocks = int_list(message, "blocks", 0, INT32_END, sum(nblk) - sum(have))
        preempted = str_list(message, "preempted")
        copies = int_list(message, "copies", 0, INT32_END, None)
        if len(copies) % 2:
            raise StepCodecError(f"step field 'copies' has {len(copies)} entries: (src, dst) block pairs need an "
                                 f"even number")
        targets = _targets(message["targets"])
        transfers = _decode_transfers(message["kv"])
        if len(set(ids)) != n:
            raise StepCodecError("step field 'ids': a request id appears twice")
        ledger = self._ledger
        held, now = ledger.tables, ledger.step
        requests = []
        t = b = 0
        for i in range(n):
            count, known, stamp = nblk[i], have[i], stamps[i]
            b_end = b + count - known
            entry = held.get(stamp) if stamp else None
            if known == 0:
                ids_list = blocks[b:b_end]
                if entry is not None:  # sent whole again: a new list (earlier BlockTables keep the old one)
                    entry[0] = ids_list
            else:
                ids_list = None if entry is None else entry[0]
                if ids_list is None or len(ids_list) != known:
                    raise StepCodecError(
                        f"step field 'have'[{i}]={known}: this rank holds "
                        f"{0 if ids_list is None else len(ids_list)} blocks of table stamp {stamp} (request "
                        f"{ids[i]!r}); the ranks' block-table ledgers disagree")
                ids_list += blocks[b:b_end]  # appended in place: earlier BlockTables of this list stay valid
            if stamp:  # the encoder's ledger update, inline (a step's requests are many; calls cost)
                if entry is None:
                    held[stamp] = [ids_list, now]
                else:
                    entry[1] = now
                    held.move_to_end(stamp)
            t_end = t + ntok[i]
            requests.append(ScheduledRequest(ids[i], tuple(tokens[t:t_end]), start[i],
                                             BlockTable(ids_list, count, stamp), nprompt[i], nsampled[i], lora[i],
                                             ropemin[i]))
            t, b = t_end, b_end
        ledger.end_step()
        return StepInput(SchedulerOutput(tuple(requests), tuple(preempted),
                                         tuple(zip(copies[::2], copies[1::2])), transfers), targets)


def _encode_transfers(transfers: KVTransfers) -> list | None:
    """[offloads as flat (block, slot) pairs, loads as flat (slot, block) pairs, wait_for_offloads]; None: none."""
    if transfers == NO_TRANSFERS:
        return None
    return [[x for pair in transfers.offloads for x in pair], [x for pair in transfers.loads for x in pair],
            transfers.wait_for_offloads]


def _decode_transfers(value: Any) -> KVTransfers:
    if value is None:
        return NO_TRANSFERS
    if type(value) is not list or len(value) != 3 or type(value[2]) is not bool:
        raise StepCodecError("step field 'kv' must be null or [offload pairs, load pairs, wait_for_offloads]")
    pairs = []
    for i, name in enumerate(("offloads", "loads")):
        flat = int_list({name: value[i]}, name, 0, INT32_END, None, f"'kv'[{i}] ({name})")
        if len(flat) % 2:
            raise StepCodecError(f"step field 'kv'[{i}] ({name}) has {len(flat)} entries: pairs need an even number")
        pairs.append(tuple(zip(flat[::2], flat[1::2])))
    return KVTransfers(pairs[0], pairs[1], value[2])


def _targets(value: Any) -> dict[str, PromptLogprobTarget]:
    if type(value) is not list:
        raise StepCodecError(f"step field 'targets' must be a list, got {type(value).__name__}")
    out = {}
    for i, item in enumerate(value):
        where = f"'targets'[{i}]"
        if type(item) is not list or len(item) != 5:
            raise StepCodecError(f"step field {where} must be [request id, prompt token ids, top_k, logprobs, "
                                 f"logits]")
        rid, token_ids, top_k, logprobs, logits = item
        if type(logprobs) is not bool or type(logits) is not bool:
            raise StepCodecError(f"step field {where}[3:5] (logprobs, logits) must be true or false")
        if type(rid) is not str:
            raise StepCodecError(f"step field {where}[0] (request id) must be a string, got {type(rid).__name__}")
        if rid in out:
            raise StepCodecError(f"step field {where}: request id {rid!r} appears twice")
        token_ids = int_list({"token_ids": token_ids}, "token_ids", 0, INT32_END, None, f"{where}[1]")
        top_k = int_value(top_k, 0, INT32_END, f"step field {where}[2] (top_k)")
        out[rid] = PromptLogprobTarget(token_ids, top_k, logprobs, logits)
    return out


# ---- a worker's start arguments --------------------------------------------------------------------------
def encode_start(engine_dir: str | Path, runtime: RuntimeConfig, launch: RankLaunch,
                 kv_cache_scales: Sequence[tuple[float, float]] | None, log_level: int) -> bytes:
    """A worker's arguments (`worker.worker_process_main`'s) as JSON bytes."""
    message = {"kind": "start", "v": FORMAT_VERSION, "engine_dir": str(engine_dir),
               "runtime": _encode_fields(runtime, _RUNTIME_FIELDS), "launch": _encode_fields(launch, _LAUNCH_FIELDS),
               "kv_cache_scales": None if kv_cache_scales is None else [[float(k), float(v)]
                                                                         for k, v in kv_cache_scales],
               "log_level": int(log_level)}
    return _DUMPS(message).encode()


def decode_start(data: bytes) -> tuple[str, RuntimeConfig, RankLaunch, list[tuple[float, float]] | None, int]:
    """(engine_dir, runtime, launch, kv_cache_scales, log_level) from `encode_start`'s bytes; StepCodecError
    for anything else."""
    message = load_message(data, "start")
    if message.get("kind") != "start":
        raise StepCodecError(f"step channel: expected the worker's start message first, got kind "
                             f"{message.get('kind')!r}")
    check_keys(message, _START_KEYS, "start message")
    engine_dir = message["engine_dir"]
    if type(engine_dir) is not str:
        raise StepCodecError(f"start message field 'engine_dir' must be a string, got {type(engine_dir).__name__}")
    runtime = RuntimeConfig(**_decode_fields(message["runtime"], _RUNTIME_FIELDS, "runtime"))
    launch = RankLaunch(**_decode_fields(message["launch"], _LAUNCH_FIELDS, "launch"))
    scales = message["kv_cache_scales"]
    if scales is not None:
        if type(scales) is not list or any(type(p) is not list or len(p) != 2 for p in scales):
            raise StepCodecError("start message field 'kv_cache_scales' must be null or a list of [k, v] pairs")
        scales = [(float_value(k, "start message field 'kv_cache_scales'"),
                   float_value(v, "start message field 'kv_cache_scales'")) for k, v in scales]
    return engine_dir, runtime, launch, scales, int_value(message["log_level"], 0, 100, "start message field 'log_level'")


def _encode_fields(config: object, schema: dict[str, str]) -> dict[str, object]:
    names = {f.name for f in dataclasses.fields(config)}
    if names != set(schema):
        raise StepCodecError(f"{type(config).__name__} fields {sorted(names ^ set(schema))} have no wire form "
                             f"in step_codec (add them to its schema)")
    out = {}
    for name, kind in schema.items():
        value = getattr(config, name)
        if value is None:
            out[name] = None
        elif kind.startswith("dtype"):
            out[name] = str(value).removeprefix("torch.")
        elif kind == "device":
            out[name] = str(value)
        else:
            out[name] = value
    return out


def _decode_fields(value: Any, schema: dict[str, str], what: str) -> dict[str, object]:
    if type(value) is not dict:
        raise StepCodecError(f"start message field '{what}' must be an object, got {type(value).__name__}")
    check_keys(value, frozenset(schema), f"start message field '{what}'")
    out = {}
    for name, kind in schema.items():
        field, item = f"start message field '{what}.{name}'", value[name]
        if kind.endswith("?"):
            if item is None:
                out[name] = None
                continue
            kind = kind[:-1]
        if kind == "int":
            out[name] = int_value(item, 0, INT32_END, field)
        elif kind == "float":
            out[name] = float_value(item, field)
        elif kind == "ints":
            out[name] = int_tuple(item, field)
        elif kind == "bool":
            if type(item) is not bool:
                raise StepCodecError(f"{field} must be true or false, got {item!r}")
            out[name] = item
        elif kind == "str":
            if type(item) is not str:
                raise StepCodecError(f"{field} must be a string, got {type(item).__name__}")
            out[name] = item
        elif kind == "dtype":
            dtype = getattr(torch, item, None) if type(item) is str else None
            if not isinstance(dtype, torch.dtype):
                raise StepCodecError(f"{field} must name a torch dtype (e.g. 'float16'), got {item!r}")
            out[name] = dtype
        else:  # device
            try:
                device = torch.device(item) if type(item) is str else None
            except RuntimeError:
                device = None
            if device is None or device.type not in ("cpu", "cuda"):
                raise StepCodecError(f"{field} must be 'cpu' or 'cuda[:N]', got {item!r}")
            out[name] = device
    return out

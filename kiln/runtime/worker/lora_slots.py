"""LoRA adapters on the device: `max_loras` slots per adapted linear, filled between steps, read per token row.

Every linear an adapter may touch (the attention and MLP projections: `qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`) gets zero tensors A [S, P*R, K] (the A of each part of a fused layer, q/k/v or gate/up, stacked)
and B [S, N, R] (S = max_loras slots, R = max_lora_rank, P parts) and a hook (`Linear.lora_hook`) that adds
the rows' products to its output with one `kiln::lora_add` call for all its parts (two kernel launches a
linear on CUDA, which CUDA graphs replay even when no row has an adapter). A slot left by an adapter that
does not touch a part keeps zeros there, which add nothing.

Adapters are read from disk (`read_lora_adapter`, thread-safe) before a request naming them is admitted: a
front end reads on a worker thread and hands the adapter to `register`, which only keeps it (called without
one, `register` reads it itself: `LLM`, whose caller is the engine thread anyway). They are kept in host
memory: those of live requests pinned (`pin`/`unpin`, by the engine as requests come and go) and never
evicted, the others least recently used first out while more than `max_cpu_loras` are held, so that `prepare`
never reads from disk. Before each step `prepare` puts the step's
adapters in slots (least recently used slot first out; never one this step uses: the scheduler runs at
most `max_loras` distinct adapters in a step) and makes the step's per-token slot tensor [T] int32 (-1: the
base model), which the hooks read; `finish` clears it, so a step without adapters costs one None check per
linear.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import nn

from kiln.checkpoints.lora_adapter import LoRAAdapter, LoRAPart, shard_adapter
from kiln.checkpoints.peft import read_lora_adapter
from kiln.engine_format.mapping import Mapping
from kiln.model_defs.config import ModelConfig
from kiln.model_defs.layers.linear import Linear
from kiln.plugins.lora import lora_add
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.scheduler import SchedulerOutput

ADAPTED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class _LayerSlots:
    """One linear's slot tensors: A [S, P*R, K] (part p's A in rows [p*R, (p+1)*R)), B [S, N, R], and the
    parts' column ends in its output (`part_ends`)."""

    def __init__(self, owner: LoRASlots, layer: Linear, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.owner = owner
        self.rank = rank
        self.part_ends = [sum(layer.output_sizes[:p + 1]) for p in range(len(layer.output_sizes))]
        self.a = torch.zeros(slots, len(self.part_ends) * rank, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, self.part_ends[-1], rank, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        slot = self.owner.current
        if slot is None:
            return
        lora_add(y, x, self.a, self.b, slot, self.owner.scale, self.part_ends)

    def load(self, slot: int, parts: tuple[LoRAPart | None, ...] | None) -> None:
        """Puts one adapter's parts of this linear (`LoRALinear.parts`, None for a part or a linear it does not
        touch) in `slot`, zeros elsewhere."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p, part in enumerate(parts or ()):
            if part is not None:
                start = self.part_ends[p - 1] if p else 0
                self.a[slot, p * self.rank:p * self.rank + part.rank].copy_(part.a)
                self.b[slot, start:self.part_ends[p], :part.rank].copy_(part.b)


class LoRASlots:
    """The device slots of one network (see the module docstring). `model_config`: the base model's, which
    adapters are checked against. `mapping`: a tensor-parallel rank's, whose slice of each adapter
    (`shard_adapter`) this rank's layers hold; None for a single rank."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype, mapping: Mapping | None = None) -> None:
        self.model_config = model_config
        self.mapping = mapping
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device = device
        self.layers: dict[str, _LayerSlots] = {}
        for module in model.modules():
            if isinstance(module, Linear) and module.prefix.rsplit(".", 1)[-1] in ADAPTED:
                hook = _LayerSlots(self, module, max_loras, max_lora_rank, dtype, device)
                self.layers[module.prefix] = hook
                module.lora_hook = hook
        # The scaling is folded into B when an adapter is read: each slot scales by one.
        self.scale = torch.ones(max_loras, dtype=torch.float32, device=device)
        self.current: torch.Tensor | None = None  # this step's [T] int32 slot per token row
        self._requests: dict[int, LoRARequest] = {}  # id -> the adapter it names
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first
        self._pins: dict[int, int] = {}  # id -> live requests naming it (pinned in host memory while > 0)
        self.num_loads = 0  # adapters put in a slot (swaps included)
        self.num_reads = 0  # adapters read from disk here (not handed over already read)

    def register(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Keeps the adapter a request names in host memory: `adapter` as `read_lora_adapter` returned it (whole:
        a tensor-parallel rank takes its slice here), or, when None and not held, read here. A LoRAError (a
        ValueError) names what cannot be served, a ValueError an id already standing for another adapter."""
        lora_int_id = request.lora_int_id
        known = self._requests.get(lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"lora_int_id={lora_int_id} already names adapter {known.lora_name!r} "
                             f"at {known.lora_path}, not {request.lora_path}: give each adapter its own id")
        if lora_int_id in self._host:
            self._host.move_to_end(lora_int_id)
            return
        adapter = self._read(request) if adapter is None else self._own(adapter)  # refused before it is recorded
        self._requests[lora_int_id] = request
        self._keep(lora_int_id, adapter)

    def holds(self, lora_int_id: int) -> bool:
        """Whether the adapter is in host memory (a plain read: any thread may ask, to skip reading it)."""
        return lora_int_id in self._host

    def pin(self, lora_int_id: int) -> None:
        """One more live request names this (registered) adapter: it stays in host memory until `unpin`."""
        self._pins[lora_int_id] = self._pins.get(lora_int_id, 0) + 1

    def unpin(self, lora_int_id: int) -> None:
        """A request naming the adapter has left (finished, aborted, failed)."""
        left = self._pins.get(lora_int_id, 0) - 1
        if left > 0:
            self._pins[lora_int_id] = left
        else:
            self._pins.pop(lora_int_id, None)
            self._trim()

    def stats(self) -> dict[str, int]:
        """Plain counters: slot_loads (adapters put in a device slot, swaps included), disk_reads (adapters read
        here rather than handed over), host_adapters (in host memory), pinned_adapters (of live requests)."""
        return {"slot_loads": self.num_loads, "disk_reads": self.num_reads, "host_adapters": len(self._host),
                "pinned_adapters": len(self._pins), "device_slots": self.max_loras}

    def knows(self, lora_int_id: int) -> bool:
        """Whether an adapter is registered under `lora_int_id`."""
        return lora_int_id in self._requests

    def discard(self, lora_int_id: int) -> None:
        """Forgets the adapter under `lora_int_id`, which no request may be using: the ranks of a
        tensor-parallel engine undo a registration that another rank refused, and ranks 1.. forget what rank 0
        evicted (`distributed/lora_sync.py`)."""
        self._requests.pop(lora_int_id, None)
        self._host.pop(lora_int_id, None)
        self._slot_of.pop(lora_int_id, None)
        self._pins.pop(lora_int_id, None)

    def place(self, schedule: SchedulerOutput) -> list[int] | None:
        """Puts the step's adapters in slots; returns each token row's slot (-1: the base model), or None
        when no row has an adapter. CUDA graphs copy these rows into their own input buffer."""
        ids = {r.lora_int_id for r in schedule.requests if r.lora_int_id}
        if not ids:
            return None
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step runs {len(ids)} LoRA adapters but max_loras={self.max_loras}")
        slot_of = {i: self._place(i, ids) for i in sorted(ids)}
        rows: list[int] = []
        for r in schedule.requests:
            rows.extend([slot_of[r.lora_int_id] if r.lora_int_id else -1] * len(r.token_ids))
        return rows

    def prepare(self, schedule: SchedulerOutput) -> None:
        """Eager steps: `place`, then the per-token slot tensor the hooks read (None when no row has one)."""
        rows = self.place(schedule)
        self.current = None if rows is None else \
            torch.tensor(rows, dtype=torch.int32).to(self.device, non_blocking=True)

    @contextmanager
    def reading(self, rows: torch.Tensor):
        """The hooks read `rows` ([T] int32 on the device) inside the block: a CUDA graph's slot buffer,
        captured with the hooks' kernels and refilled before each replay."""
        self.current = rows
        try:
            yield
        finally:
            self.current = None

    def finish(self) -> None:
        self.current = None

    # ---- internals -----------------------------------------------------------------------------
    def _place(self, lora_int_id: int, in_step: set[int]) -> int:
        slot = self._slot_of.get(lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_int_id)
            return slot
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter that this step does not run
            victim = next(i for i in self._slot_of if i not in in_step)
            slot = self._slot_of.pop(victim)
        self._load(slot, self._adapter(lora_int_id))
        self._slot_of[lora_int_id] = slot
        self.num_loads += 1
        return slot

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for prefix, layer in self.layers.items():
            linear = adapter.get(prefix)
            layer.load(slot, None if linear is None else linear.parts)

    def _adapter(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora_int_id)
            return adapter
        # Evicted from host memory: never an adapter the engine pinned (every live request's), so only on a rank
        # that is not told pins.
        adapter = self._read(self._requests[lora_int_id])
        self._keep(lora_int_id, adapter)
        return adapter

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = read_lora_adapter(request.lora_path, self.model_config, max_lora_rank=self.max_lora_rank,
                                    name=request.lora_name)
        self.num_reads += 1
        return self._own(adapter)

    def _own(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """This rank's slice of a whole adapter."""
        return adapter if self.mapping is None else shard_adapter(adapter, self.model_config, self.mapping)

    def _keep(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_int_id] = adapter
        self._host.move_to_end(lora_int_id)
        self._trim(spare=lora_int_id)  # about to be pinned by the request that brought it

    def _trim(self, spare: int = 0) -> None:
        """Evicts unpinned adapters, least recently used first, while more than max_cpu_loras are held."""
        unpinned = [i for i in self._host if i not in self._pins and i != spare]
        for lora_int_id in unpinned[:max(0, len(self._host) - self.max_cpu_loras)]:
            del self._host[lora_int_id]

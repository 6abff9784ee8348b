"""LoRA adapters on the device: `max_loras` slots per adapted linear, filled between steps, read per token row.

Every linear an adapter may touch (the attention and MLP projections: `qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`) gets, per part of a fused layer (q/k/v, gate/up), zero tensors A [S, R, K] and B [S, N_part, R]
(S = max_loras slots, R = max_lora_rank) and a hook (`Linear.lora_hook`) that adds the rows' products to its
output with `kiln::lora_add`, one call per part on that part's column slice. A slot left by an adapter that
does not touch a part keeps zeros there, which add nothing.

Adapters are read from disk once (`read_lora_adapter`) when a request names them (`register`) and kept in
host memory, least recently used first out past `max_cpu_loras`. Before each step `prepare` puts the step's
adapters in slots (least recently used slot first out; never one this step uses: the scheduler runs at
most `max_loras` distinct adapters in a step) and makes the step's per-token slot tensor [T] int32 (-1: the
base model), which the hooks read; `finish` clears it, so a step without adapters costs one None check per
linear.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from kiln.checkpoints.lora_adapter import LoRAAdapter
from kiln.checkpoints.peft import read_lora_adapter
from kiln.model_defs.config import ModelConfig
from kiln.model_defs.layers.linear import Linear
from kiln.plugins.lora import lora_add
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.scheduler import SchedulerOutput

ADAPTED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class _LayerSlots:
    """One linear's slot tensors, per part: (column offset, A [S, R, K], B [S, n, R])."""

    def __init__(self, owner: LoRASlots, layer: Linear, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.owner = owner
        self.parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        offset = 0
        for size in layer.output_sizes:
            self.parts.append((offset, torch.zeros(slots, rank, layer.in_features, dtype=dtype, device=device),
                               torch.zeros(slots, size, rank, dtype=dtype, device=device)))
            offset += size

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        slot = self.owner.current
        if slot is None:
            return
        for offset, a, b in self.parts:
            lora_add(y[:, offset:offset + b.shape[1]], x, a, b, slot, self.owner.scale)


class LoRASlots:
    """The device slots of one network (see the module docstring). `model_config`: the base model's, which
    adapters are checked against."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model_config = model_config
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
        self.num_loads = 0  # adapters put in a slot (swaps included)

    def register(self, request: LoRARequest) -> None:
        """Reads (or finds) the adapter a request names; a LoRAError (a ValueError) names what cannot be served,
        a ValueError an id already standing for another adapter."""
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(f"lora_int_id={request.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"at {known.lora_path}, not {request.lora_path}: give each adapter its own id")
            self._adapter(request.lora_int_id)
            return
        adapter = self._read(request)  # refused before the id is recorded
        self._requests[request.lora_int_id] = request
        self._keep(request.lora_int_id, adapter)

    def prepare(self, schedule: SchedulerOutput) -> None:
        """Puts the step's adapters in slots and sets the per-token slot tensor (None when no row has one)."""
        ids = {r.lora_int_id for r in schedule.requests if r.lora_int_id}
        if not ids:
            self.current = None
            return
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step runs {len(ids)} LoRA adapters but max_loras={self.max_loras}")
        slot_of = {i: self._place(i, ids) for i in sorted(ids)}
        rows: list[int] = []
        for r in schedule.requests:
            rows.extend([slot_of[r.lora_int_id] if r.lora_int_id else -1] * len(r.token_ids))
        self.current = torch.tensor(rows, dtype=torch.int32).to(self.device, non_blocking=True)

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
            for k, (_, a, b) in enumerate(layer.parts):
                a[slot].zero_()
                b[slot].zero_()
                part = None if linear is None else linear.parts[k]
                if part is not None:
                    a[slot, :part.rank].copy_(part.a)
                    b[slot, :, :part.rank].copy_(part.b)

    def _adapter(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora_int_id)
            return adapter
        adapter = self._read(self._requests[lora_int_id])  # evicted from host memory: read again
        self._keep(lora_int_id, adapter)
        return adapter

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        return read_lora_adapter(request.lora_path, self.model_config, max_lora_rank=self.max_lora_rank,
                                 name=request.lora_name)

    def _keep(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_int_id] = adapter
        self._host.move_to_end(lora_int_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

"""The inputs of captured CUDA graphs, and their capture: device buffers allocated once (a graph holds raw addresses) and the
pinned host staging they are copied from before each replay.

Two staging sets are used in turn: with async scheduling the host fills the next step's inputs while the
copies of the step before may still wait in the GPU's queue, so a set is refilled only once the copies out
of it have run (its event; in practice long since).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def capture_sizes_into(sizes: Sequence[int], forward: Callable[[int], torch.Tensor], pool,
                       graphs: dict[int, torch.cuda.CUDAGraph], outputs: dict[int, torch.Tensor]) -> None:
    """Captures `forward(size)` for every size, largest first (the smaller ones reuse its memory), into `pool`
    (a graph pool handle shared with graphs that never run at the same time; None: a new one): the graph
    into graphs[size], the tensor it returns (which every replay rewrites) into outputs[size]."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    for i, size in enumerate(sorted(sizes, reverse=True)):
        if i == 0:
            # One eager run, of the largest size, settles the allocator and cuBLAS outside any capture. The smaller
            # sizes are captured without one: their kernels are the engine's stored ones (or Triton compiles and
            # loads them on first launch, which capture allows); an eager run each cost the 8B engine's startup
            # 0.6-0.9 s of its 1.9 s of graphs (H200, 32 decode + 6 prefill sizes).
            forward(size)
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize()


def release_graphs(graphs: dict[int, torch.cuda.CUDAGraph], device: torch.device) -> None:
    """Destroys captured graphs, once the device has run what was queued (a replay may still be running); leaves
    `graphs` empty."""
    if graphs:
        torch.cuda.synchronize(device)
    for graph in graphs.values():
        graph.reset()
    graphs.clear()


class OutputBuffer:
    """One output tensor for every captured size of a family of graphs, [max_rows, ...]: each graph writes its
    prefix (a graph holds raw addresses, so the buffer is never reallocated). Allocated at the first write, the
    eager run of the largest size that precedes the captures, from the shape that run computes: a graph per
    size with an output of its own would hold a [size, V] float32 logits tensor each (GBs at batch 1024)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.buffer: torch.Tensor | None = None

    def write(self, rows: int, compute: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        """buffer[:rows], written by `compute(out)`: it writes its [rows, ...] result into `out` when given, else
        returns it as a new tensor."""
        if self.buffer is None:
            value = compute(None)
            self.buffer = torch.empty((self.max_rows, *value.shape[1:]), dtype=value.dtype, device=value.device)
            return self.buffer[:rows].copy_(value)
        return compute(self.buffer[:rows])


class GraphInputs:
    """`specs`: name -> (shape, dtype) of each buffer. `buffers[name]` is the device tensor graphs read;
    `stage()` hands out the next staging set (host tensors of the same shapes) and `upload()` copies it over."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.buffers = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in specs.items()}
        cuda = device.type == "cuda"  # off CUDA (tests of the host side) nothing is pinned or waited for
        self._sets = [({name: torch.zeros(shape, dtype=dtype, pin_memory=cuda) for name, (shape, dtype) in specs.items()},
                       torch.cuda.Event() if cuda else None) for _ in range(2)]
        self._turn = 0
        self.last_staged: dict[str, torch.Tensor] | None = None  # the set the last upload copied from

    def stage(self) -> dict[str, torch.Tensor]:
        """The staging set to fill for the next upload (waits until its previous copies have run)."""
        staged, copied = self._sets[self._turn]
        if copied is not None:
            copied.synchronize()  # a never-recorded event returns at once
        return staged

    def upload(self, rows: dict[str, int] | None = None) -> None:
        """Queues the copies of the staged set into the device buffers (non-blocking): whole buffers, or the
        first `rows[name]` rows of those named."""
        staged, copied = self._sets[self._turn]
        self._turn ^= 1
        for name, buffer in self.buffers.items():
            n = (rows or {}).get(name)
            # Whole rows of contiguous buffers: a strided slice would not copy asynchronously.
            (buffer if n is None else buffer[:n]).copy_(staged[name] if n is None else staged[name][:n],
                                                        non_blocking=True)
        if copied is not None:
            copied.record()
        self.last_staged = staged

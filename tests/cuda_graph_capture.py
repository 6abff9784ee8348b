"""Captures a function of CUDA tensors in a CUDA graph, the way the runtime does (tests only)."""

from __future__ import annotations

import torch


def capture(step):
    """Runs step() once on a side stream (Triton compiles and loads its kernels there: neither may happen
    inside a capture), then captures it. Returns (graph, what the captured call returned): replaying the graph
    rewrites those outputs from the captured input buffers' current contents."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out

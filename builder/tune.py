"""Build-time kernel tuning: time the candidate launch settings of the tunable kernels at the engine's own
shapes on the target GPU, and return the winners for engine.json's `target.kernel_settings`.

Tuned today: the W4A16 / W8A16 weight-only GEMM at decode sizes (up to 16 tokens a step, one tile height),
where the best tile width and split of K depend on the layer's shape and the GPU (on an H100 the winners
stream 20-25% more bytes a second than the shape heuristic). Each candidate runs 20 times inside a CUDA graph,
the way the runtime runs decode steps, so launch overhead does not decide. Candidates that do not compile or
run on this GPU are skipped. The runtime reads the table through plugins/tuning.py and times nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.model_defs.layers.linear import Linear
from kiln.quant.weight_only import WeightOnlyLinear

logger = logging.getLogger(__name__)

DECODE_TOKENS = 1  # the shape tuned for the decode tile height (every step of up to 16 tokens shares it)


@dataclass(frozen=True, order=True)
class WeightOnlyShape:
    """One weight-only product the network launches: y[T, n] = x[T, k] @ W^T."""
    n: int
    k: int
    bits: int
    group_size: int
    asymmetric: bool
    act_order: bool


def weight_only_shapes(network: nn.Module) -> list[WeightOnlyShape]:
    """The distinct weight-only products of `network` (built on the meta device for the rank being built): a
    fused layer whose parts are smoothed apart launches one product per part, as WeightOnlyLinear.apply does."""
    shapes = set()
    for module in network.modules():
        method = getattr(module, "method", None)
        if not isinstance(module, Linear) or not isinstance(method, WeightOnlyLinear):
            continue
        per_part = method.smoothed and method.per_part_smoothing and not method.act_order
        for n in (module.output_sizes if per_part else (module.out_features,)):
            shapes.add(WeightOnlyShape(n, module.in_features, method.bits, method.group(module.in_features),
                                       method.asymmetric, method.act_order))
    return sorted(shapes)


# time_fn(shape, tokens, settings) -> seconds a launch, or None when the settings cannot run
TimeFn = Callable[[WeightOnlyShape, int, dict], "float | None"]


def tune_weight_only(shapes: list[WeightOnlyShape], time_fn: TimeFn) -> dict[str, dict]:
    """{tuning key: winning settings} over each shape's candidates (two rounds, triton_weight_only's)."""
    from kiln.plugins.triton_weight_only import tuning_candidates, tuning_key

    table = {}
    for shape in shapes:
        t = DECODE_TOKENS
        first, second = tuning_candidates()
        timed = _timed(shape, t, first, time_fn)
        if not timed:
            logger.warning("tuning: no candidate ran for %s; the runtime uses its heuristic", shape)
            continue
        timed += _timed(shape, t, second(min(timed, key=lambda r: r[0])[1]), time_fn)
        best_s, best = min(timed, key=lambda r: r[0])
        key = tuning_key(t, shape.n, shape.k, shape.bits, shape.group_size, shape.act_order, shape.asymmetric)
        table[key] = best
        logger.info("tuning: %s -> %s (%.1f us)", key, best, best_s * 1e6)
    return table


def _timed(shape: WeightOnlyShape, t: int, candidates: list[dict], time_fn: TimeFn) -> list[tuple[float, dict]]:
    out = []
    for cfg in candidates:
        seconds = time_fn(shape, t, cfg)
        if seconds is not None:
            out.append((seconds, cfg))
    return out


def cuda_time_fn(device: torch.device, dtype: torch.dtype) -> TimeFn:
    """Times weight-only launches on `device` with random weights of each shape (made once per shape)."""
    from kiln.plugins.triton_weight_only import _launch, config_with

    cache: dict[tuple, tuple] = {}

    def inputs(shape: WeightOnlyShape, t: int) -> tuple:
        key = (shape, t)
        if key not in cache:
            cache.clear()  # one shape's tensors at a time
            gen = torch.Generator(device=device).manual_seed(0)
            cols = shape.k // 2 if shape.bits == 4 else shape.k
            high = 256 if shape.bits == 4 or shape.asymmetric else 128
            qweight = torch.randint(0 if high == 256 else -128, high, (shape.n, cols), generator=gen,
                                    device=device, dtype=torch.int32).to(torch.uint8 if high == 256 else torch.int8)
            groups = shape.k // shape.group_size
            scales = torch.rand(shape.n, groups, generator=gen, device=device) * 1e-2
            zeros = (torch.randint(0, 2 ** shape.bits, (shape.n, groups), generator=gen, device=device,
                                   dtype=torch.int32).to(torch.uint8) if shape.asymmetric else None)
            g_idx = ((torch.arange(shape.k, device=device) // shape.group_size).to(torch.int32)
                     if shape.act_order else None)
            x = torch.randn(t, shape.k, generator=gen, device=device).to(dtype)
            cache[key] = (x, qweight, scales, zeros, shape.bits, shape.group_size, None, None, g_idx)
        return cache[key]

    def time_fn(shape: WeightOnlyShape, t: int, settings: dict) -> float | None:
        args = inputs(shape, t)
        cfg = config_with(t, shape.k, shape.group_size, shape.act_order, **settings)
        try:
            return graph_seconds(lambda: _launch(*args, cfg))
        except Exception as e:  # a candidate this GPU cannot run (shared memory, registers): not a winner
            logger.debug("tuning: %s %s failed: %s", shape, settings, e)
            return None

    return time_fn


def graph_seconds(fn: Callable[[], object], launches: int = 20, replays: int = 5) -> float:
    """Seconds per call of `fn`, `launches` calls captured in one CUDA graph and replayed."""
    fn()  # compile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the capture stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * launches)


def tune_kernels(network: nn.Module, dtype: torch.dtype, device: torch.device,
                 time_fn: TimeFn | None = None) -> dict[str, dict[str, dict]]:
    """The `target.kernel_settings` of an engine whose rank network (meta device) is `network`, tuned on
    `device`: {kernel: {shape key: settings}}; empty when nothing in the network is tunable."""
    from kiln.plugins.triton_weight_only import TUNED_KERNEL

    start = time.perf_counter()
    settings = {}
    shapes = weight_only_shapes(network)
    if shapes:
        settings[TUNED_KERNEL] = tune_weight_only(shapes, time_fn or cuda_time_fn(device, dtype))
        logger.info("tuned %d weight-only GEMM shape(s) on %s in %.1f s", len(shapes),
                    torch.cuda.get_device_name(device) if device.type == "cuda" else device,
                    time.perf_counter() - start)
    return settings

"""Build-time kernel tuning: time the candidate launch settings of the tunable kernels at the engine's own
shapes on the target GPU, and return the winners for engine.json's `target.kernel_settings`.

Tuned today, at decode sizes (up to 16 tokens a step, one tile height), where the best tile width and split
of K depend on the layer's shape and the GPU: the W4A16 / W8A16 weight-only GEMM (`weight_only_linear`; on
an H100 the winners stream 20-25% more bytes a second than the old shape heuristic) and the FP8 / INT8 W8A8
GEMM (`scaled_linear`). Each candidate runs 20 times inside a CUDA graph, the way the runtime runs decode
steps, so launch overhead does not decide. Candidates that do not compile or run on this GPU are skipped.
The runtime reads the table through plugins/tuning.py and times nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.model_defs.layers.linear import Linear
from kiln.quant.fp8 import Fp8Linear
from kiln.quant.int8_sq import Int8SqLinear
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
    # a layer whose parts smooth x apart (AWQ's qkv, gate_up): their row counts, launched as one product
    # (weight_only_linear_parts) with tiles that end on the parts' bounds
    parts: tuple[int, ...] = ()


@dataclass(frozen=True, order=True)
class ScaledShape:
    """One W8A8 product the network launches: FP8 or INT8 weights [n, k], activations quantized per step."""
    n: int
    k: int
    int8: bool


def _quantized_linears(network: nn.Module, kind: type):
    for module in network.modules():
        if isinstance(module, Linear) and isinstance(getattr(module, "method", None), kind):
            yield module, module.method


def weight_only_shapes(network: nn.Module) -> list[WeightOnlyShape]:
    """The distinct weight-only products of `network` (built on the meta device for the rank being built): a
    fused layer whose parts are smoothed apart is one product of parts, as WeightOnlyLinear.apply launches it."""
    shapes = set()
    for module, method in _quantized_linears(network, WeightOnlyLinear):
        per_part = method.smoothed and method.per_part_smoothing and not method.act_order
        parts = tuple(module.output_sizes) if per_part and len(module.output_sizes) > 1 else ()
        shapes.add(WeightOnlyShape(module.out_features, module.in_features, method.bits,
                                   method.group(module.in_features), method.asymmetric, method.act_order, parts))
    return sorted(shapes)


def scaled_shapes(network: nn.Module) -> list[ScaledShape]:
    """The distinct FP8 / INT8 W8A8 products of `network` (Fp8Linear, Int8SqLinear)."""
    shapes = {ScaledShape(m.out_features, m.in_features, False) for m, _ in _quantized_linears(network, Fp8Linear)}
    shapes |= {ScaledShape(m.out_features, m.in_features, True) for m, _ in _quantized_linears(network, Int8SqLinear)}
    return sorted(shapes)


# time_fn(shape, tokens, settings) -> seconds a launch, or None when the settings cannot run
TimeFn = Callable[[object, int, dict], "float | None"]
# candidates: (first round, second round around the first's winner), as the kernel modules give them
Candidates = tuple[list[dict], Callable[[dict], list[dict]]]


def tune_shapes(shapes: list, candidates: Candidates, key_of: Callable[[object, int], str],
                time_fn: TimeFn) -> dict[str, dict]:
    """{tuning key: winning settings}: for each shape, the first round's candidates, then the second round's
    around its winner; the fastest of all wins. A shape none of whose candidates ran gets no entry."""
    first, second = candidates
    table = {}
    for shape in shapes:
        t = DECODE_TOKENS
        timed = _timed(shape, t, first, time_fn)
        if not timed:
            logger.warning("tuning: no candidate ran for %s; the runtime uses its heuristic", shape)
            continue
        timed += _timed(shape, t, second(min(timed, key=lambda r: r[0])[1]), time_fn)
        best_s, best = min(timed, key=lambda r: r[0])
        key = key_of(shape, t)
        table[key] = best
        logger.info("tuning: %s -> %s (%.1f us)", key, best, best_s * 1e6)
    return table


def tune_weight_only(shapes: list[WeightOnlyShape], time_fn: TimeFn) -> dict[str, dict]:
    """{tuning key: winning settings} of the weight-only GEMM (triton_weight_only's candidates and keys)."""
    from kiln.plugins.triton_weight_only import tuning_candidates, tuning_key

    return tune_shapes(shapes, tuning_candidates(), lambda s, t: tuning_key(
        t, s.n, s.k, s.bits, s.group_size, s.act_order, s.asymmetric), time_fn)


def tune_scaled(shapes: list[ScaledShape], time_fn: TimeFn) -> dict[str, dict]:
    """{tuning key: winning settings} of the W8A8 GEMM (triton_scaled_linear's candidates and keys)."""
    from kiln.plugins.triton_scaled_linear import tuning_candidates, tuning_key

    return tune_shapes(shapes, tuning_candidates(), lambda s, t: tuning_key(t, s.n, s.k, s.int8), time_fn)


def _timed(shape, t: int, candidates: list[dict], time_fn: TimeFn) -> list[tuple[float, dict]]:
    out = []
    for cfg in candidates:
        seconds = time_fn(shape, t, cfg)
        if seconds is not None:
            out.append((seconds, cfg))
    return out


def _cuda_time_fn(make_inputs: Callable[[object, int, torch.Generator], tuple],
                  launch: Callable[[tuple, dict], object], device: torch.device) -> TimeFn:
    """Times launch(inputs, settings) in CUDA graphs, with random inputs made once per shape."""
    cache: dict[tuple, tuple] = {}

    def time_fn(shape, t: int, settings: dict) -> float | None:
        if (shape, t) not in cache:
            cache.clear()  # one shape's tensors at a time
            cache[(shape, t)] = make_inputs(shape, t, torch.Generator(device=device).manual_seed(0))
        args = cache[(shape, t)]
        try:
            return graph_seconds(lambda: launch(args, settings))
        except Exception as e:  # a candidate this GPU cannot run (shared memory, registers): not a winner
            logger.debug("tuning: %s %s failed: %s", shape, settings, e)
            return None

    return time_fn


def weight_only_time_fn(device: torch.device, dtype: torch.dtype) -> TimeFn:
    """Times weight-only launches on `device` with random weights of each shape."""
    from kiln.plugins.triton_weight_only import _launch, config_with
    from kiln.plugins.triton_weight_only_parts import parts_fit

    def make_inputs(shape: WeightOnlyShape, t: int, gen: torch.Generator) -> tuple:
        cols = shape.k // 2 if shape.bits == 4 else shape.k
        unsigned = shape.bits == 4 or shape.asymmetric
        qweight = torch.randint(0 if unsigned else -128, 256 if unsigned else 128, (shape.n, cols), generator=gen,
                                device=device, dtype=torch.int32).to(torch.uint8 if unsigned else torch.int8)
        groups = shape.k // shape.group_size
        scales = torch.rand(shape.n, groups, generator=gen, device=device) * 1e-2
        zeros = (torch.randint(0, 2 ** shape.bits, (shape.n, groups), generator=gen, device=device,
                               dtype=torch.int32).to(torch.uint8) if shape.asymmetric else None)
        g_idx = ((torch.arange(shape.k, device=device) // shape.group_size).to(torch.int32)
                 if shape.act_order else None)
        x = torch.randn(t, shape.k, generator=gen, device=device).to(dtype)
        pqs = torch.ones(len(shape.parts), shape.k, device=device) if shape.parts else None  # [P, K]
        return (x, qweight, scales, zeros, shape.bits, shape.group_size, None, pqs, g_idx), shape.parts

    def launch(inputs: tuple, settings: dict):
        args, parts = inputs
        x, group_size, g_idx = args[0], args[5], args[8]  # x: [T, K]
        cfg = config_with(x.shape[0], x.shape[1], group_size, g_idx is not None, **settings)
        if parts and not parts_fit(parts, cfg.block_n):
            raise ValueError(f"tiles of {cfg.block_n} columns cross the bounds of parts {parts}")
        return _launch(*args, cfg, parts or None)

    return _cuda_time_fn(make_inputs, launch, device)


def scaled_time_fn(device: torch.device, dtype: torch.dtype) -> TimeFn:
    """Times W8A8 GEMM launches (activations already quantized, as the op quantizes them before) on `device`."""
    from kiln.plugins.triton_scaled_linear import GemmConfig, _launch

    def make_inputs(shape: ScaledShape, t: int, gen: torch.Generator) -> tuple:
        x = torch.randn(t, shape.k, generator=gen, device=device).to(dtype)
        if shape.int8:
            weight = torch.randint(-127, 128, (shape.n, shape.k), generator=gen, device=device,
                                   dtype=torch.int32).to(torch.int8)
            x_q = torch.randint(-127, 128, (t, shape.k), generator=gen, device=device, dtype=torch.int32).to(torch.int8)
        else:
            weight = torch.randn(shape.n, shape.k, generator=gen, device=device).to(torch.float8_e4m3fn)
            x_q = torch.randn(t, shape.k, generator=gen, device=device).to(torch.float8_e4m3fn)
        s_x = torch.rand(t, 1, generator=gen, device=device)
        w_scale = torch.rand(shape.n, generator=gen, device=device)
        return (x, x_q, s_x, weight, w_scale, None, x.new_empty((t, shape.n)))

    def launch(args: tuple, settings: dict):
        return _launch(*args, GemmConfig(16, **settings))

    return _cuda_time_fn(make_inputs, launch, device)


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
                 time_fns: dict[str, TimeFn] | None = None) -> dict[str, dict[str, dict]]:
    """The `target.kernel_settings` of an engine whose rank network (meta device) is `network`, tuned on
    `device`: {kernel: {shape key: settings}}; empty when nothing in the network is tunable. `time_fns`
    replaces the CUDA timing per kernel name (tests)."""
    from kiln.plugins.triton_scaled_linear import TUNED_KERNEL as SCALED
    from kiln.plugins.triton_weight_only import TUNED_KERNEL as WEIGHT_ONLY

    time_fns = time_fns or {}
    start = time.perf_counter()
    settings = {}
    work = [(WEIGHT_ONLY, weight_only_shapes(network), tune_weight_only, weight_only_time_fn),
            (SCALED, scaled_shapes(network), tune_scaled, scaled_time_fn)]
    for kernel, shapes, tune, default_time_fn in work:
        if not shapes:
            continue
        settings[kernel] = tune(shapes, time_fns.get(kernel) or default_time_fn(device, dtype))
        logger.info("tuned %s for %d shape(s) on %s in %.1f s", kernel, len(shapes),
                    torch.cuda.get_device_name(device) if device.type == "cuda" else device,
                    time.perf_counter() - start)
    return settings

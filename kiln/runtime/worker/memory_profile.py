"""The activation peak of one step at the engine's limits, measured on CUDA before the KV cache is sized."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.model_defs import CausalLM, ModelConfig
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.sampling.sampler import Sampler, SamplingRow
from kiln.runtime.worker import memory
from kiln.runtime.worker.kv_cache import KVCache
from kiln.runtime.worker.step_inputs import build_context


@torch.inference_mode()
def profile_activation_bytes(model: CausalLM, *, max_num_tokens: int, max_batch_size: int, max_seq_len: int,
                             block_size: int, kv_dtype: torch.dtype, device: torch.device,
                             fraction: float, kv_scales: Sequence[tuple[float, float]] | None = None,
                             cache_config: ModelConfig | None = None) -> int:
    """Peak memory of one step at the limits: max_num_tokens tokens through the network, logits and a
    top-p sampling pass for max_batch_size rows. Runs on a throwaway cache just big enough (with the
    engine's scales for a quantized cache: its quantize and dequantize copies count too). `cache_config`:
    the heads this rank's cache holds (default: the model's)."""
    tokens = max_num_tokens
    seq_len = min(max_seq_len, tokens)
    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // block_size)
    torch.cuda.synchronize(device)
    cache = hidden = logits = None
    try:
        cache = KVCache(cache_config or model.config, blocks_per_seq * len(lengths), block_size, kv_dtype, device, kv_scales)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        ctx = build_context(
            positions=[p for n in lengths for p in range(n)], rope_lengths=[seq_len] * tokens,
            slots=[s * blocks_per_seq * block_size + p for s, n in enumerate(lengths) for p in range(n)],
            tables=[list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(len(lengths))],
            query_lens=lengths, kv_caches=cache.layers, device=device, kv_scales=cache.scales)
        hidden = model(torch.zeros(tokens, dtype=torch.int64, device=device), ctx)
        rows = torch.arange(max_batch_size, device=device) % tokens
        logits = model.compute_logits(hidden[rows])
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=True, top_logprobs=5)
        Sampler()(logits, [SamplingRow(params, [0], [])] * max_batch_size)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    except torch.OutOfMemoryError:
        raise memory.out_of_memory(f"profiling a step of {tokens} tokens", fraction) from None
    finally:
        cache = hidden = logits = None
        torch.cuda.empty_cache()
    return peak

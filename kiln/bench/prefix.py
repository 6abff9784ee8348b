"""`kiln bench prefix`: time to first token of a prompt whose long prefix was seen before, served from each
tier of the prefix cache: recomputed, from the device pool, from the host tier (`--kv-offloading-size`) and,
after a restart, from the disk tier (`--kv-offloading-dir`).

Each timed request is a prefix of `prefix_len` random tokens plus a fresh tail of `tail_len` tokens (the tail is
always computed), generating one token. Per iteration a new prefix is computed once (recompute), repeated
(device), dropped from the device pool only (`LLM.reset_prefix_cache(device_only=True)`) and repeated again
(host). The disk tier is timed by the caller after a restart (`time_disk`), on the same prefixes.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.llm import LLM

TIERS = ("recompute", "device", "host", "disk")
_ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class PrefixSpec:
    prefix_len: int = 2000
    tail_len: int = 16
    num_iters: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefix_len", "tail_len", "num_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")


class PrefixBench:
    """The prompts and timings of one run; `times[tier]` are seconds per request, `cached[tier]` the cached
    prompt tokens each request reported for that tier."""

    def __init__(self, spec: PrefixSpec, vocab_size: int) -> None:
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._vocab = vocab_size
        self.prefixes = [self._tokens(spec.prefix_len) for _ in range(spec.num_iters)]
        self.times: dict[str, list[float]] = {tier: [] for tier in TIERS}
        self.cached: dict[str, list[int]] = {tier: [] for tier in TIERS}

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self._vocab) for _ in range(n)]

    def _time(self, llm: LLM, tier: str, prefix: list[int]) -> None:
        start = time.perf_counter()
        out = llm.generate(prefix + self._tokens(self.spec.tail_len), _ONE_TOKEN)[0]
        self.times[tier].append(time.perf_counter() - start)
        m = out.metrics
        self.cached[tier].append({"recompute": out.num_cached_tokens, "device": m.num_cached_tokens_device,
                                  "host": m.num_cached_tokens_host, "disk": m.num_cached_tokens_disk}[tier])

    def warm_up(self, llm: LLM) -> None:
        """Untimed requests of the same length (kernels, graphs, allocator)."""
        for _ in range(2):
            llm.generate(self._tokens(self.spec.prefix_len + self.spec.tail_len), _ONE_TOKEN)

    def time_tiers(self, llm: LLM) -> None:
        """recompute, device and (with a host tier) host for every prefix."""
        host = llm.kv_cache_stats().get("host_tier_slots", 0) > 0
        for prefix in self.prefixes:
            self._time(llm, "recompute", prefix)
            self._time(llm, "device", prefix)
            if host:
                llm.reset_prefix_cache(device_only=True)
                self._time(llm, "host", prefix)

    def time_disk(self, llm: LLM) -> None:
        """After a restart over the same disk directory: every prefix once more."""
        for prefix in self.prefixes:
            self._time(llm, "disk", prefix)

    def summary(self) -> dict:
        return {tier: {"ttft_ms_median": 1000 * statistics.median(t), "ttft_ms": [1000 * x for x in t],
                       "cached_tokens": self.cached[tier]}
                for tier, t in self.times.items() if t}


def format_rows(summary: dict, spec: PrefixSpec) -> list[tuple[str, str]]:
    rows = []
    for tier in TIERS:
        if tier in summary:
            s = summary[tier]
            rows.append((f"TTFT {tier} ms", f"{s['ttft_ms_median']:.1f} (cached tokens {min(s['cached_tokens'])}"
                                            f"/{spec.prefix_len + spec.tail_len})"))
    return rows

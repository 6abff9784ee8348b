"""Prometheus metrics of one server: request outcomes, latencies, token counts, and engine gauges read
from the KV-cache statistics at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# `*_created` timestamp series only clutter the exposition (process-wide setting of prometheus_client).
disable_created_metrics()

# How a request ended: finish reasons, "abort" (client went away, or shutdown), "rejected" (invalid),
# "overloaded" (refused because the queue was full: --max-queued-requests), "error" (the engine failed).
OUTCOMES = ("stop", "length", "abort", "rejected", "overloaded", "error")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServeMetrics:
    """The server's metrics, in a registry of their own (several servers may live in one process)."""

    def __init__(self, engine_stats: Callable[[], dict[str, int]],
                 speculation_stats: Callable[[], dict | None] = lambda: None,
                 loras_loaded: Callable[[], int] = lambda: 0,
                 lora_stats: Callable[[], dict | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests", "Requests by outcome (stop, length, abort, rejected, overloaded, error)",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Generated tokens", registry=r)
        self.time_to_first_token = Histogram("kiln_time_to_first_token_seconds",
                                             "From arrival to the first generated token", buckets=_LATENCY_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram("kiln_inter_token_latency_seconds",
                                             "Between consecutive generated tokens of a request",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("kiln_e2e_request_latency_seconds", "From arrival to the last token",
                                     buckets=_E2E_BUCKETS, registry=r)
        self.lora_requests = Counter("kiln_lora_requests", "Engine requests that ran with a LoRA adapter, by adapter",
                                     ["lora_name"], registry=r)
        self.loras_loaded = Gauge("kiln_lora_adapters_loaded", "LoRA adapters served now (--lora-modules and "
                                  "/v1/load_lora_adapter)", registry=r)
        self.loras_loaded.set_function(loras_loaded)
        r.register(_EngineCollector(engine_stats, speculation_stats, lora_stats))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engine's counters when scraped."""

    def __init__(self, engine_stats: Callable[[], dict[str, int]], speculation_stats: Callable[[], dict | None],
                 lora_stats: Callable[[], dict | None] = lambda: None) -> None:
        self._stats = engine_stats
        self._speculation = speculation_stats
        self._lora = lora_stats

    def describe(self):
        return []

    def collect(self):
        s = self._stats()
        total = s["total_blocks"]
        used = total - s["free_blocks"]
        yield GaugeMetricFamily("kiln_num_requests_running", "Requests being generated", value=s["num_running"])
        yield GaugeMetricFamily("kiln_num_requests_waiting", "Requests queued for admission", value=s["num_waiting"])
        yield GaugeMetricFamily("kiln_kv_cache_blocks", "KV-cache blocks in all", value=total)
        yield GaugeMetricFamily("kiln_kv_cache_free_blocks", "KV-cache blocks that could be allocated now",
                                value=s["free_blocks"])
        yield GaugeMetricFamily("kiln_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                                value=used / total if total else 0.0)
        queried, hit = s["prefix_cache_query_tokens"], s["prefix_cache_hit_tokens"]
        yield CounterMetricFamily("kiln_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=queried)
        yield CounterMetricFamily("kiln_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=hit)
        yield GaugeMetricFamily("kiln_prefix_cache_hit_rate", "Hit tokens / queried tokens since start",
                                value=hit / queried if queried else 0.0)
        yield CounterMetricFamily("kiln_num_preemptions", "Requests preempted (and recomputed later)",
                                  value=s["num_preemptions"])
        yield from _kv_tier_families(s)
        lora = self._lora()
        if lora is not None:  # with --enable-lora: adapters swapped into the engine's device slots
            yield CounterMetricFamily("kiln_lora_slot_loads", "LoRA adapters put into a device slot (--max-loras), "
                                      "swaps included", value=lora["slot_loads"])
        spec = self._speculation()
        if spec is not None:  # vLLM's spec_decode counters; rates are ratios of them
            yield CounterMetricFamily("kiln_spec_decode_num_drafts", "Verify steps of a request with drafts",
                                      value=spec["num_drafts"])
            yield CounterMetricFamily("kiln_spec_decode_num_draft_tokens", "Draft tokens proposed and verified",
                                      value=spec["num_draft_tokens"])
            yield CounterMetricFamily("kiln_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                      value=spec["num_accepted_tokens"])
            per_position = CounterMetricFamily("kiln_spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted at each draft position (0-based)",
                                               labels=["position"])
            for position, count in enumerate(spec["accepted_per_position"]):
                per_position.add_metric([str(position)], count)
            yield per_position


def _kv_tier_families(s: dict):
    """The prefix cache's host and disk tiers (--kv-offloading-size, --kv-offloading-dir), labelled by tier;
    nothing without them."""
    tiers = [t for t in ("host", "disk") if f"{t}_tier_hits" in s]
    if not tiers:
        return
    names = {"host": {"blocks": "blocks", "stores": "stores"}, "disk": {"blocks": "files", "stores": "writes"}}
    for name, doc, kind, key in (
            ("kiln_kv_tier_blocks", "KV blocks a tier holds now", GaugeMetricFamily, "blocks"),
            ("kiln_kv_tier_stores", "KV blocks copied into a tier", CounterMetricFamily, "stores"),
            ("kiln_kv_tier_hits", "KV blocks a prompt found in a tier instead of recomputing them",
             CounterMetricFamily, "hits"),
            ("kiln_kv_tier_misses", "Disk-tier reads that found no valid file (recomputed)", CounterMetricFamily,
             "misses"),
            ("kiln_kv_tier_evictions", "KV blocks a tier dropped to make room (the host tier's go to disk)",
             CounterMetricFamily, "evictions")):
        family = kind(name, doc, labels=["tier"])
        for tier in tiers:
            value = s.get(f"{tier}_tier_{names[tier].get(key, key)}")
            if value is not None:
                family.add_metric([tier], value)
        yield family
    size = GaugeMetricFamily("kiln_kv_tier_bytes", "Bytes a tier holds now", labels=["tier"])
    slots = s.get("host_tier_num_slots", 0)
    size.add_metric(["host"], s["host_tier_blocks"] * s["host_tier_nbytes"] // slots if slots else 0)
    if "disk_tier_bytes" in s:
        size.add_metric(["disk"], s["disk_tier_bytes"])
    yield size
    seconds = CounterMetricFamily("kiln_kv_tier_copy_seconds", "Time spent copying KV blocks, by direction",
                                  labels=["direction"])
    for direction, key in (("device_to_host", "host_tier_offload_seconds"), ("host_to_device", "host_tier_load_seconds"),
                           ("host_to_disk", "disk_tier_write_seconds"), ("disk_to_host", "disk_tier_read_seconds")):
        if key in s:
            seconds.add_metric([direction], s[key])
    yield seconds

"""Measuring tools over the public API: `kiln bench latency|throughput` (offline), `kiln eval perplexity`
and `kiln bench serve` (an HTTP load generator against a running server)."""

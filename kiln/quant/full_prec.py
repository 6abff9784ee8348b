"""`full_prec`: no weight quantization (the checkpoint's dtype); its config is None, so every layer keeps
the unquantized linear method. An engine can still quantize its KV cache (--kv-cache-dtype)."""

from __future__ import annotations

from .registry import QuantScheme, register

register(QuantScheme("full_prec", lambda p: None, order=0))

"""The quantization formats. Importing the package imports every scheme module, each of which registers
its scheme (registry.py), so the registry is full before any kiln.quant module is used."""

from . import fp8, fp8_block, full_prec, int4_awq, int8_sq, mxfp4, weight_only_formats  # noqa: F401  (they register)

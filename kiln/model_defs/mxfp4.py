"""MXFP4 dequantization for the model defs (GPT-OSS's `--dequantize` recipes): the format and its dequantizer
live in plugins/mxfp4.py, beside the MXFP4 MoE operator that also reads it; re-exported here for the recipes."""

from __future__ import annotations

from kiln.plugins.mxfp4 import BLOCK as BLOCK
from kiln.plugins.mxfp4 import E2M1_VALUES as E2M1_VALUES
from kiln.plugins.mxfp4 import dequantize_mxfp4 as dequantize_mxfp4

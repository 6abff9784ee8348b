"""DeepSeek (multi-head latent attention, DeepSeek-MoE) on CUDA: a tiny engine's greedy tokens equal the CPU
reference's with CUDA graphs on and off (the MLA kernel itself: tests/test_kernels_mla.py)."""

from __future__ import annotations

import pytest
import torch
from test_models_deepseek import CASES, PROMPTS, make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_cuda_deepseek_engine_matches_cpu_greedy(tmp_path, name):
    architecture, overrides = CASES[name]
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    limits = dict(max_batch_size=4, max_num_tokens=32, max_seq_len=128)
    cpu = LLM(build_engine(checkpoint, tmp_path / "cpu", BuildConfig(**limits), progress=False))
    gpu_engine = build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", **limits), progress=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in cpu.generate(PROMPTS, params)]
    for graphs in (True, False):
        gpu = LLM(gpu_engine, num_kv_blocks=48, cuda_graphs=graphs)
        assert [o.token_ids for o in gpu.generate(PROMPTS, params)] == expected, f"cuda_graphs={graphs}"
        stats = gpu.kv_cache_stats()
        assert stats["free_blocks"] == stats["total_blocks"]
        del gpu

"""The whole runtime on a CUDA device through the reference operators: same greedy tokens as the CPU."""

from __future__ import annotations

import pytest
import torch
from model_factory import make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_cuda_engine_matches_cpu_greedy(tmp_path, architecture):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture)
    limits = dict(max_batch_size=4, max_num_tokens=32, max_seq_len=128, kv_block_size=4)
    cpu = LLM(build_engine(checkpoint, tmp_path / "cpu", BuildConfig(**limits), progress=False))
    gpu = LLM(build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", **limits), progress=False),
              num_kv_blocks=48)
    prompts = [[(5 * i + n) % 390 + 2 for i in range(n)] for n in (1, 9, 40, 23, 60, 3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == [o.token_ids for o in cpu.generate(prompts, params)]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, logprobs=True, ignore_eos=True)
    alone = gpu.generate(prompts[1], seeded)[0]
    batched = gpu.generate(prompts[:3], [params, seeded, params])[1]
    assert batched.token_ids == alone.token_ids
    stats = gpu.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_cuda_engine_refuses_cpu_and_reports_target(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", dtype="bfloat16",
                                                                    max_seq_len=64), progress=False)
    from kiln.builder.engine_format import EngineError, load_engine_spec

    spec = load_engine_spec(engine)
    assert spec.target["compute_capability"] == list(torch.cuda.get_device_capability())
    with pytest.raises(EngineError, match="rebuild it with `kiln build --device cpu`"):
        LLM(engine, device="cpu")
    out = LLM(engine).generate("the cat", SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) >= 1

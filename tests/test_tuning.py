"""Build-time kernel tuning (builder/tune.py): which products an engine tunes, how winners are picked and
recorded, how the runtime hands them to the kernels and what it does with another GPU's; on the device, a
tuned build of a quantized engine."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from model_factory import make_checkpoint
from triton_interpret import needs_triton

from kiln.builder.build import build_engine, load_model_config
from kiln.builder.build_config import BuildConfig
from kiln.builder.tune import (
    ScaledShape,
    WeightOnlyShape,
    scaled_shapes,
    tune_kernels,
    tune_weight_only,
    weight_only_shapes,
)
from kiln.engine_format import load_engine_spec
from kiln.model_defs import build_network
from kiln.plugins import tuning
from kiln.quant.spec import QuantSpec
from kiln.runtime.worker.kernel_settings import install_kernel_settings


@pytest.fixture(autouse=True)
def _empty_table():
    tuning.clear()
    yield
    tuning.clear()


def _meta_network(tmp_path, qformat: str, group_size: int | None):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    model_def, config = load_model_config(checkpoint)
    quant = QuantSpec(qformat=qformat, group_size=group_size, kv_cache_dtype="auto").quant_config()
    with torch.device("meta"):
        return build_network(model_def, config, quant, dtype=torch.bfloat16)


def test_weight_only_shapes_are_the_products_the_network_launches(tmp_path):
    # hidden 64, 4 heads of 16 (2 kv heads), intermediate 128: qkv 64+32+32, o, gate+up 128+128, down.
    shapes = weight_only_shapes(_meta_network(tmp_path, "int4_wo", 32))
    assert [(s.n, s.k) for s in shapes] == [(64, 64), (64, 128), (128, 64), (256, 64)]
    assert {(s.bits, s.group_size, s.asymmetric, s.act_order) for s in shapes} == {(4, 32, True, False)}  # int4_wo: zero points


def test_awq_layers_of_parts_are_one_product_each(tmp_path):
    # AWQ smooths q, k, v (and gate, up) apart: one weight_only_linear_parts product per fused layer.
    shapes = weight_only_shapes(_meta_network(tmp_path, "int4_awq", 32))
    assert [(s.n, s.k, s.parts) for s in shapes] == [(64, 64, ()), (64, 128, ()), (128, 64, (64, 32, 32)),
                                                     (256, 64, (128, 128))]


def test_scaled_shapes_are_the_fp8_and_int8_products(tmp_path):
    fp8 = _meta_network(tmp_path, "fp8", None)
    assert scaled_shapes(fp8) == [ScaledShape(64, 64, False), ScaledShape(64, 128, False),
                                  ScaledShape(128, 64, False), ScaledShape(256, 64, False)]
    assert weight_only_shapes(fp8) == []
    assert {s.int8 for s in scaled_shapes(_meta_network(tmp_path, "int8_sq", None))} == {True}


@needs_triton
def test_tune_kernels_tunes_what_the_network_has_under_each_kernels_name(tmp_path):
    from kiln.plugins.triton_scaled_linear import tuning_key

    seen = []

    def fake_time(shape, t, cfg):
        seen.append(shape)
        return 1e-5 / cfg["split_k"] + 1e-7 * cfg["num_warps"]  # more splits, fewer warps: faster

    settings = tune_kernels(_meta_network(tmp_path, "fp8", None), torch.bfloat16, torch.device("cpu"),
                            time_fns={"scaled_linear": fake_time})
    assert list(settings) == ["scaled_linear"]
    assert settings["scaled_linear"][tuning_key(1, 256, 64, False)] == {
        "block_n": 32, "split_k": 8, "num_warps": 2, "num_stages": 3}
    assert len(settings["scaled_linear"]) == 4 and {type(s) for s in seen} == {ScaledShape}
    checkpoint, _ = make_checkpoint(tmp_path / "plain", "LlamaForCausalLM")
    model_def, config = load_model_config(checkpoint)
    with torch.device("meta"):
        plain = build_network(model_def, config, None, dtype=torch.bfloat16)
    assert tune_kernels(plain, torch.bfloat16, torch.device("cpu"), time_fns={}) == {}


def test_weight_only_shapes_of_a_full_precision_network_are_none(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    model_def, config = load_model_config(checkpoint)
    with torch.device("meta"):
        assert weight_only_shapes(build_network(model_def, config, None, dtype=torch.bfloat16)) == []


@needs_triton
def test_the_fastest_candidate_of_each_shape_is_recorded_under_its_key():
    from kiln.plugins.triton_weight_only import tuning_key

    shapes = [WeightOnlyShape(4096, 4096, 4, 128, False, False), WeightOnlyShape(64, 64, 8, 64, True, True)]
    calls = []

    def fake_time(shape, t, cfg):  # split 8 of 128-wide tiles is fastest; 16 splits "do not compile"
        calls.append((shape, t, cfg))
        if cfg["split_k"] == 16:
            return None
        return (abs(cfg["split_k"] - 8) + (cfg["block_n"] != 128) + (cfg["num_warps"] != 2) +
                (cfg["num_stages"] != 4)) * 1e-6 + 1e-5

    table = tune_weight_only(shapes, fake_time)
    best = {"block_n": 128, "block_k": 64, "split_k": 8, "num_warps": 2, "num_stages": 4}
    assert table[tuning_key(1, 4096, 4096, 4, 128, False, False)]["split_k"] == 8
    assert table == {tuning_key(1, s.n, s.k, s.bits, s.group_size, s.act_order, s.asymmetric): table[
        tuning_key(1, s.n, s.k, s.bits, s.group_size, s.act_order, s.asymmetric)] for s in shapes}
    for settings in table.values():
        assert {k: settings[k] for k in ("block_n", "split_k", "num_warps", "num_stages")} == {
            k: best[k] for k in ("block_n", "split_k", "num_warps", "num_stages")}
    assert {t for _, t, _ in calls} == {1}
    assert tune_weight_only(shapes, lambda *a: None) == {}  # nothing ran: no entry, the heuristic stays


@needs_triton
def test_the_kernel_launches_with_the_tuned_settings_of_its_shape(monkeypatch):
    from kiln.plugins import triton_weight_only as wo

    seen = []
    monkeypatch.setattr(wo, "_launch", lambda *args: seen.append(args[-1]) or torch.zeros(1))
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    qweight, scales = torch.zeros(512, 128, dtype=torch.uint8), torch.ones(512, 2)
    wo.weight_only_linear_triton(x, qweight, scales, None, 4, 128, None, None)
    heuristic = seen.pop()
    settings = {"block_n": 32, "block_k": 64, "split_k": 2, "num_warps": 2, "num_stages": 5}
    tuning.install({wo.TUNED_KERNEL: {wo.tuning_key(3, 512, 256, 4, 128, False, False): settings}})
    wo.weight_only_linear_triton(x, qweight, scales, None, 4, 128, None, None)
    tuned = seen.pop()
    assert tuned != heuristic
    assert (tuned.block_n, tuned.block_k, tuned.split_k, tuned.num_warps, tuned.num_stages) == (32, 64, 2, 2, 5)
    assert tuned.group_aligned and tuned.k_per_split == 128
    wo.weight_only_linear_triton(x, qweight, scales, None, 4, 64, None, None)  # another group: another key
    assert seen.pop() != tuned


def _spec_with(tmp_path, gpu_name):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(), progress=False)
    data = json.loads((engine / "engine.json").read_text())
    assert data["target"]["kernel_settings"] == {}  # a CPU build tunes nothing
    data["target"].update(gpu_name=gpu_name, kernel_settings={"weight_only_linear": {"m16_n64_k64_int4_zp_g32": {
        "block_n": 64, "block_k": 32, "split_k": 1, "num_warps": 2, "num_stages": 2}}})
    (engine / "engine.json").write_text(json.dumps(data))
    return load_engine_spec(engine, verify_checksums=False)


def test_settings_tuned_on_this_gpu_model_are_installed(tmp_path, monkeypatch):
    spec = _spec_with(tmp_path, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert not install_kernel_settings(spec, torch.device("cpu"))  # CPU tensors never read the table
    assert install_kernel_settings(spec, torch.device("cuda", 0))
    assert tuning.lookup("weight_only_linear", "m16_n64_k64_int4_zp_g32")["block_n"] == 64


def test_another_gpus_settings_are_left_out_with_a_warning_naming_both(tmp_path, monkeypatch, caplog):
    spec = _spec_with(tmp_path, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        assert not install_kernel_settings(spec, torch.device("cuda", 0))
    assert tuning.lookup("weight_only_linear", "m16_n64_k64_int4_zp_g32") is None
    assert "tuned for NVIDIA H100 80GB HBM3 but runs on NVIDIA H200" in caplog.text
    assert "rebuild it on this GPU" in caplog.text


def test_build_flag_no_tune_reaches_the_build_config():
    from kiln.cli import make_parser

    args = make_parser().parse_args(["build", "--checkpoint", "c", "--output", "o", "--no-tune"])
    assert args.no_tune
    assert BuildConfig(tune=False).tune is False


# --- GPU: a tuned build ---

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_build_of_a_weight_only_engine_records_and_uses_tuned_settings(tmp_path):
    from kiln.plugins.triton_weight_only import TUNED_KERNEL
    from kiln.runtime import LLM, SamplingParams

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    limits = dict(device="cuda", dtype="bfloat16", max_batch_size=4, max_num_tokens=64, max_seq_len=128,
                  qformat="int4_wo", awq_block_size=32)
    tuned = build_engine(checkpoint, tmp_path / "tuned", BuildConfig(**limits), progress=False)
    plain = build_engine(checkpoint, tmp_path / "plain", BuildConfig(tune=False, **limits), progress=False)
    target = load_engine_spec(tuned).target
    assert sorted(target["kernel_settings"][TUNED_KERNEL]) == [
        "m16_n128_k64_int4_zp_g32", "m16_n256_k64_int4_zp_g32", "m16_n64_k128_int4_zp_g32",
        "m16_n64_k64_int4_zp_g32"]
    assert load_engine_spec(plain).target["kernel_settings"] == {}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[(5 * i + n) % 390 + 2 for i in range(n)] for n in (3, 17, 40)]
    with_tuning = [o.token_ids for o in LLM(tuned).generate(prompts, params)]
    assert tuning.lookup(TUNED_KERNEL, "m16_n64_k64_int4_zp_g32") is not None
    tuning.clear()
    assert with_tuning == [o.token_ids for o in LLM(plain).generate(prompts, params)]


def test_the_build_summary_names_the_tuned_kernels_and_gpu(tmp_path):
    from kiln.commands.build_summary import engine_summary

    spec = _spec_with(tmp_path, "NVIDIA H100 80GB HBM3")
    assert "kernels tuned for NVIDIA H100 80GB HBM3: weight_only_linear (1 shape)" in engine_summary(
        spec.engine_dir)
    data = json.loads((spec.engine_dir / "engine.json").read_text())
    data["target"]["kernel_settings"] = {}
    (spec.engine_dir / "engine.json").write_text(json.dumps(data))
    assert "tuned" not in engine_summary(spec.engine_dir)


@pytest.mark.parametrize("bad, named", [
    ([1, 2], "target.kernel_settings is [1, 2]"),
    ({"weight_only_linear": 3}, "target.kernel_settings.weight_only_linear is 3"),
    ({"weight_only_linear": {"m16": {"block_n": "wide"}}}, "target.kernel_settings.weight_only_linear.m16"),
])
def test_malformed_kernel_settings_are_an_engine_error_naming_the_entry(tmp_path, bad, named):
    from kiln.engine_format import EngineError

    spec = _spec_with(tmp_path, "NVIDIA H100 80GB HBM3")
    spec.target["kernel_settings"] = bad
    with pytest.raises(EngineError, match=named.replace("[", r"\[").replace("]", r"\]")):
        install_kernel_settings(spec, torch.device("cpu"))
    assert tuning.lookup("weight_only_linear", "m16") is None

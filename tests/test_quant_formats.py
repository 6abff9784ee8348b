"""The quantization formats' build-time conversion (kiln.quant), unit by unit: each format's quantize
against ModelOpt's rounding rules done by hand, fused layers exact, the engine.json record, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kiln.model_defs.layers.linear import Linear
from kiln.plugins.int4_pack import unpack_int4
from kiln.quant.base import LinearPart, QuantError
from kiln.quant.calib_data import DEFAULT_NAME, calibration_samples, read_calibration_texts
from kiln.quant.formats import QFORMATS, check_qformat, quant_config
from kiln.quant.fusion import share_pre_quant_scale
from kiln.quant.spec import CalibrationRecord, QuantSpec

torch.manual_seed(0)


def _layer(qformat: str, in_features: int, out_sizes: tuple[int, ...], dtype=torch.float32, bias=False) -> Linear:
    method = quant_config(qformat, 32).linear_method("model.layers.0.self_attn.qkv_proj", in_features,
                                                     sum(out_sizes), dtype)
    return Linear(in_features, sum(out_sizes), bias, method, output_sizes=out_sizes)


def _load(layer: Linear, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        param = getattr(layer, name)
        assert param.dtype == t.dtype and param.shape == t.shape, name
        param.data = t


def _parts(in_features=64, sizes=(32, 16, 16), amax=True, pqs=False, same_pqs=True):
    parts = []
    shared = torch.rand(in_features) + 0.5
    for i, n in enumerate(sizes):
        w = torch.randn(n, in_features) * 0.1
        s = (shared if same_pqs else torch.rand(in_features) + 0.5) if pqs else None
        parts.append(LinearPart(f"model.layers.0.self_attn.{'qkv'[i]}_proj", w,
                                weight_amax=None, input_amax=torch.tensor(3.0 + i) if amax else None,
                                pre_quant_scale=s))
    return parts


def _close(y, ref, tolerance):
    """Relative error of the whole output: per-element error is the format's rounding, summed over K."""
    return ((y - ref).norm() / ref.norm()).item() < tolerance


def _reference(parts, x):
    # x: [T, K] -> [T, sum(out)]: what the calibrated model computes in float
    return torch.cat([F.linear(x * (p.pre_quant_scale if p.pre_quant_scale is not None else 1.0), p.weight)
                      for p in parts], dim=1)


def test_fp8_keeps_a_scale_per_part_of_a_fused_layer():
    parts = _parts()
    layer = _layer("fp8", 64, (32, 16, 16))
    tensors = layer.method.quantize(parts)
    _load(layer, tensors)
    for p, rows in zip(parts, (slice(0, 32), slice(32, 48), slice(48, 64))):
        scale = p.weight.abs().amax() / 448  # ModelOpt's per-tensor FP8 scale, the part's own
        assert torch.allclose(tensors["weight_scale"][rows], scale.expand(p.out_features))
        expected = (p.weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(tensors["weight"][rows].view(torch.uint8), expected.view(torch.uint8))
    # The parts read one input: the fused layer's input scale is the tightest of their ranges.
    assert torch.allclose(tensors["input_scale"], torch.tensor([3.0 / 448]))
    x = torch.randn(5, 64).clamp(-3, 3)
    assert _close(layer(x), _reference(parts, x), 0.08)


def test_int8_sq_per_channel_weights_and_smoothing():
    parts = _parts(pqs=True)
    layer = _layer("int8_sq", 64, (32, 16, 16))
    tensors = layer.method.quantize(parts)
    _load(layer, tensors)
    w = torch.cat([p.weight for p in parts])
    scale = w.abs().amax(dim=1) / 127
    assert torch.allclose(tensors["weight_scale"], scale)
    assert torch.equal(tensors["weight"], torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
    assert torch.equal(tensors["pre_quant_scale"], parts[0].pre_quant_scale)
    x = torch.randn(5, 64).clamp(-2, 2)
    assert _close(layer(x), _reference(parts, x), 0.03)


def test_share_pre_quant_scale_is_exact_in_float():
    parts = _parts(pqs=True, same_pqs=False)
    shared = share_pre_quant_scale(parts)
    assert all(torch.equal(p.pre_quant_scale, shared[0].pre_quant_scale) for p in shared)
    assert all(p.weight_amax is None for p in shared)  # measured again from the rescaled weight
    x = torch.randn(7, 64)
    assert torch.allclose(_reference(shared, x), _reference(parts, x), atol=1e-5)
    # The new input range bounds the new input: |x * mean| <= amax_i * max(mean / pqs_i) for x within amax_i.
    for before, after in zip(parts, shared):
        assert after.input_amax >= before.input_amax * (shared[0].pre_quant_scale / before.pre_quant_scale).max() - 1e-6


def test_int4_awq_symmetric_groups_with_modelopt_block_amax():
    parts = _parts(pqs=True)
    # ModelOpt gives block amax as [out * in / group, 1]; a clipped amax must be used as given.
    parts[0] = LinearPart(parts[0].name, parts[0].weight, weight_amax=torch.full((32 * 2, 1), 0.2),
                          pre_quant_scale=parts[0].pre_quant_scale)
    layer = _layer("int4_awq", 64, (32, 16, 16))
    tensors = layer.method.quantize(parts)
    _load(layer, tensors)
    assert torch.allclose(tensors["scales"][:32], torch.full((32, 2), 0.2 / 7))
    q = unpack_int4(tensors["qweight"]).int() - 8
    expected = torch.round(parts[0].weight.reshape(32, 2, 32) / (0.2 / 7)).clamp(-8, 7).reshape(32, 64)
    assert torch.equal(q[:32], expected.int())
    x = torch.randn(3, 64)
    assert _close(layer(x), _reference(parts, x), 0.15)


def test_int4_wo_asymmetric_round_trip_error_is_within_half_a_step():
    parts = _parts(amax=False)
    layer = _layer("int4_wo", 64, (32, 16, 16))
    tensors = layer.method.quantize(parts)
    q = unpack_int4(tensors["qweight"]).float().reshape(64, 2, 32)
    dequant = ((q - tensors["zeros"].float()[..., None]) * tensors["scales"][..., None]).reshape(64, 64)
    w = torch.cat([p.weight for p in parts])
    step = tensors["scales"].repeat_interleave(32, dim=1)
    assert ((dequant - w).abs() <= step / 2 + 1e-6).all()


def test_int8_wo_per_channel():
    parts = _parts(amax=False)
    layer = _layer("int8_wo", 64, (32, 16, 16))
    tensors = layer.method.quantize(parts)
    _load(layer, tensors)
    assert tensors["scales"].shape == (64, 1)
    x = torch.randn(4, 64)
    assert _close(layer(x), _reference(parts, x), 0.02)


def test_calibrated_formats_refuse_parts_without_input_ranges():
    with pytest.raises(QuantError, match="no calibrated input range"):
        _layer("fp8", 64, (32, 16, 16)).method.quantize(_parts(amax=False))


def test_a_group_size_that_does_not_divide_a_layer_is_named_before_any_work():
    with pytest.raises(QuantError, match=r"model.layers.0.mlp.down_proj: in_features 96 is not divisible by the "
                                         r"group size 64.*--awq-block-size"):
        quant_config("int4_awq", 64).linear_method("model.layers.0.mlp.down_proj", 96, 64, torch.float32)


def test_lm_head_stays_in_the_model_dtype():
    for qformat in QFORMATS[1:]:
        assert quant_config(qformat, 32).linear_method("lm_head", 64, 100, torch.float32) is None


def test_unknown_qformat_lists_the_valid_ones():
    with pytest.raises(QuantError, match="unknown --qformat 'int3'; valid: full_prec, fp8, int8_sq, int4_awq"):
        check_qformat("int3")


def test_quant_spec_round_trips_and_names_bad_keys():
    spec = QuantSpec("int4_awq", "fp8", 128, modelopt_version="0.47.0",
                     calibration=CalibrationRecord("x.txt", 8, 256, 2048, 1.5))
    assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(QuantError, match="unknown key"):
        QuantSpec.from_dict({**spec.to_dict(), "nbits": 4})
    with pytest.raises(QuantError, match="qformat='nf4'"):
        QuantSpec.from_dict({**spec.to_dict(), "qformat": "nf4"})
    with pytest.raises(QuantError, match="group_size"):
        QuantSpec.from_dict({**spec.to_dict(), "qformat": "fp8"})


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"", "is empty"),
    (b"  \n", "is empty"),
    (b"caf\xe9 au lait", "is not UTF-8 text"),
    (b'{"text": "a"}\n{"txt": "b"}\n', "line 2 has no string 'text' field"),
    (b'{"text": "a"}\nnot json\n', "line 2 is not JSON"),
])
def test_bad_calibration_files_are_named(tmp_path, content, message):
    path = tmp_path / "calib.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(QuantError, match=rf"--calib-dataset .*calib.txt.*{message}"):
        read_calibration_texts(path)


class _Tokenizer:
    """Characters as tokens, BOS = 0 in front of a text."""

    def __call__(self, text, add_special_tokens=True, verbose=True):
        class Out:
            input_ids = ([0] if add_special_tokens else []) + [ord(c) for c in text]
        return Out()


def test_plain_text_is_cut_into_windows_that_start_like_a_prompt(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("abcdefghij")
    samples = calibration_samples(read_calibration_texts(path), _Tokenizer(), 10, 4)
    assert samples == [[0, 97, 98, 99], [0, 100, 101, 102], [0, 103, 104, 105], [0, 106]]
    assert len(calibration_samples(read_calibration_texts(path), _Tokenizer(), 2, 4)) == 2


def test_json_lines_are_one_sample_each(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "abc"}\n\n{"text": "defgh", "id": 3}\n')
    assert calibration_samples(read_calibration_texts(path), _Tokenizer(), 10, 4) == [[0, 97, 98, 99],
                                                                                       [0, 100, 101, 102]]


def test_the_default_sample_ships_with_kiln():
    data = read_calibration_texts(None)
    assert data.name == DEFAULT_NAME and len(data.texts[0]) > 200_000


def test_int4_awq_keeps_each_parts_own_smoothing():
    parts = _parts(pqs=True, same_pqs=False)
    layer = _layer("int4_awq", 64, (32, 16, 16))
    tensors = layer.method.quantize(parts)
    assert tensors["pre_quant_scale"].shape == (3, 64)
    for i, p in enumerate(parts):
        assert torch.equal(tensors["pre_quant_scale"][i], p.pre_quant_scale)
    _load(layer, tensors)
    x = torch.randn(3, 64)
    assert _close(layer(x), _reference(parts, x), 0.15)

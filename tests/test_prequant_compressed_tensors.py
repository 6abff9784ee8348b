"""`kiln build` of compressed-tensors checkpoints (tests/fixtures/compressed_tensors/, made by llm-compressor:
scripts/make_compressed_tensors_fixtures.py): each scheme's engine.json record, and kiln's greedy tokens and
prompt logprobs against a float32 transformers model whose weights this file dequantizes itself from the
format's definition, with the runtime's activation and KV-cache quantization applied as fake quantization;
then against transformers' own loading of the checkpoint (its compressed-tensors integration). Refusals
name the field, value or tensor.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.checkpoints.prequant.compressed_tensors import unpack_int32
from kiln.engine_format import load_engine_spec
from kiln.runtime import LLM, SamplingParams

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "compressed_tensors"
SMALL = dict(dtype="float32", max_seq_len=128, max_batch_size=8, max_num_tokens=64)
PROMPTS = [[5, 17, 99, 3, 8, 250, 31, 7, 64, 2, 90, 11], [300, 1, 44, 120, 121, 122], [9, 9, 9, 200]]
NEW_TOKENS = 8
FP8_MAX, INT8_MAX = 448.0, 127.0
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}

W4A16_EXCLUDED = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.qkv_proj", "lm_head"]
# fixture -> what engine.json's build_config.quantization records (besides source and kv_cache_dtype)
CASES = {
    "fp8": dict(qformat="fp8"),
    "fp8_dynamic": dict(qformat="fp8_dynamic"),
    "fp8_kv": dict(qformat="fp8_dynamic"),
    "fp8_block": dict(qformat="fp8_block", block_size=[32, 32]),
    "w8a8_int8": dict(qformat="int8_dynamic"),
    "w8a8_int8_static": dict(qformat="int8_sq"),
    "w4a16": dict(qformat="weight_only", bits=4, group_size=32, exclude_modules=W4A16_EXCLUDED),
    "w4a16_asym": dict(qformat="weight_only", bits=4, group_size=32, zero_point=True),
    "w8a16": dict(qformat="weight_only", bits=8, group_size=None),
    "w8a16_asym": dict(qformat="weight_only", bits=8, group_size=32, zero_point=True),
}


def _build(checkpoint: Path, output: Path, **options) -> Path:
    return build_engine(checkpoint, output, BuildConfig(**{**SMALL, **options}), progress=False)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Each fixture built once, lazily."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _build(FIXTURES / name, tmp_path_factory.mktemp(name) / "engine")
        return built[name]

    return get


@functools.cache
def _kiln_outputs(engine: Path) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    outs = LLM(engine).generate(PROMPTS, params)
    return [o.token_ids for o in outs], [o.prompt_logprobs[1:] for o in outs]


def _reference_outputs(model) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens (whole-sequence recompute, no cache) and prompt logprobs of a transformers model."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            lp = model(ids).logits[0, :-1].float().log_softmax(-1)
            logprobs.append(lp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            tokens.append(ids[0, len(prompt):].tolist())
    return tokens, logprobs


# --- the test's own reading of the format -------------------------------------------------------------------

def _unpack_bytes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int32 words -> signed codes, through the words' bytes (little-endian host): byte j of a word holds
    codes 4j/bits.., the low nibble first; every code is stored plus 2^(bits-1)."""
    assert sys.byteorder == "little"
    b = packed.contiguous().view(torch.uint8).to(torch.int32)  # [R, 4W]
    u = b if bits == 8 else torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], -1)
    return u[:, :cols] - (1 << (bits - 1))


def _expand(scale: torch.Tensor, args: dict, n: int, k: int) -> torch.Tensor:
    """A scale or zero point tensor of the weight's strategy -> [n, k]."""
    strategy = args["strategy"]
    if strategy == "tensor":
        return scale.reshape(1, 1).expand(n, k)
    if strategy == "channel":
        return scale.reshape(n, 1).expand(n, k)
    if strategy == "group":
        return scale.repeat_interleave(args["group_size"], dim=1)
    b0, b1 = args["block_structure"]
    return scale.repeat_interleave(b0, dim=0)[:n].repeat_interleave(b1, dim=1)[:, :k]


def _dequantized(module: str, tensors: dict[str, torch.Tensor], args: dict) -> torch.Tensor:
    """(q - zero_point) * scale in float32 [N, K]."""
    bits = args["num_bits"]
    if f"{module}.weight_packed" in tensors:
        n, k = tensors[f"{module}.weight_shape"].tolist()
        q = _unpack_bytes(tensors[f"{module}.weight_packed"], bits, k).float()
    else:
        q = tensors[f"{module}.weight"].float()
        n, k = q.shape
    if not args["symmetric"]:
        zp = tensors[f"{module}.weight_zero_point"]
        groups = zp.shape[1]
        zp = _unpack_bytes(zp.t(), bits, n).t() if zp.dtype == torch.int32 else zp  # packed along rows
        q = q - _expand(zp.float().reshape(n, groups), args, n, k)
    return q * _expand(tensors[f"{module}.weight_scale"].float(), args, n, k)


def _fake_quantize(x: torch.Tensor, kind: str, scale: torch.Tensor | None, group: int | None,
                   int8_qmax: float = INT8_MAX) -> torch.Tensor:
    """What the runtime does to a quantized layer's input: static per-tensor (`scale`), dynamic per token
    (amax / qmax), or dynamic per token and group of `group` columns (fp8_block); x: [..., K]."""
    qmax = FP8_MAX if kind == "float" else int8_qmax
    shape = x.shape
    if group is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    s = scale if scale is not None else (x.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-12)
    if kind == "float":
        q = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        q = torch.round(x / s).clamp(-128, 127)
    return (q * s).reshape(shape)


def _attention_with_fp8_kv(scales: list[tuple[float, float]]):
    """sdpa attention that first stores k and v (after RoPE) as the FP8 cache does: x / scale in e4m3."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fq(x: torch.Tensor, s: float) -> torch.Tensor:
        return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        return sdpa_attention_forward(module, query, fq(key, k_scale), fq(value, v_scale), attention_mask, **kwargs)

    return attention


def reference_model(checkpoint: Path, int8_token_qmax: float = INT8_MAX) -> transformers.PreTrainedModel:
    """The checkpoint's model in float32 with every quantized weight dequantized here, each quantized layer's
    input fake-quantized as the runtime quantizes it (a fused q/k/v or gate/up reads one input with the
    largest of its parts' static scales; INT8 per-token scales are amax / `int8_token_qmax`), and an FP8 KV
    cache fake-quantized with the checkpoint's scales."""
    raw = json.loads((checkpoint / "config.json").read_text())
    qc = raw.pop("quantization_config")
    (group,) = qc["config_groups"].values()
    wargs, aargs = group["weights"], group["input_activations"]
    tensors = load_file(checkpoint / "model.safetensors")
    config = transformers.LlamaConfig.from_dict(raw)
    attn = "sdpa"
    if qc.get("kv_cache_scheme"):
        n = config.num_hidden_layers
        scales = [(tensors[f"model.layers.{i}.self_attn.k_scale"].item(),
                   tensors[f"model.layers.{i}.self_attn.v_scale"].item()) for i in range(n)]
        attn = "kiln_fp8_kv_reference"
        transformers.AttentionInterface.register(attn, _attention_with_fp8_kv(scales))
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    state = {}
    quantized = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    for name in model.state_dict():
        module = name.removesuffix(".weight")
        state[name] = _dequantized(module, tensors, wargs) if module in quantized else tensors[name].float()
    model.load_state_dict(state, strict=True)
    if aargs is not None:
        for module in quantized:
            scale = None
            if not aargs["dynamic"]:
                parent, _, leaf = module.rpartition(".")
                siblings = [m for m in quantized if m.rpartition(".")[0] == parent
                            and FUSED.get(m.rpartition(".")[2], m) == FUSED.get(leaf, module)]
                scale = torch.stack([tensors[f"{m}.input_scale"].float().reshape(()) for m in siblings]).amax()
            hook = (lambda kind, s, g: lambda mod, args: (_fake_quantize(args[0], kind, s, g, int8_token_qmax),))(
                aargs["type"], scale, aargs.get("group_size"))
            model.get_submodule(module).register_forward_pre_hook(hook)
    return model


# --- builds and outputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_engine_records_the_scheme(engines, name):
    build = load_engine_spec(engines(name)).build_config
    recorded = build["quantization"]
    expected = {"exclude_modules": ["lm_head"], "group_size": None, "bits": None, "zero_point": False,
                "block_size": None, "kv_cache_dtype": "fp8" if name == "fp8_kv" else "auto", **CASES[name]}
    assert {k: recorded[k] for k in expected} == expected
    assert recorded["source"].startswith("compressed-tensors 0.19.0 ")
    assert recorded["modelopt_version"] is None and recorded["calibration"] is None
    assert build["kv_cache_dtype"] == ("fp8" if name == "fp8_kv" else "float32")
    if name == "fp8_kv":
        tensors = load_file(FIXTURES / name / "model.safetensors")
        assert build["kv_cache_scales"] == [
            [pytest.approx(tensors[f"model.layers.{i}.self_attn.{kv}_scale"].item(), rel=1e-7) for kv in "kv"]
            for i in range(2)]
    else:
        assert build["kv_cache_scales"] is None


@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_the_dequantized_reference(engines, name):
    tokens, logprobs = _kiln_outputs(engines(name))
    model = reference_model(FIXTURES / name)
    ref_tokens, ref_logprobs = _reference_outputs(model)
    # Both float32; what remains is the order of float32 sums (and, rarely, an activation a rounding step away
    # from another FP8/INT8 value).
    assert _worst(logprobs, ref_logprobs) < 2e-4
    _assert_greedy_agrees(name, model, tokens, ref_tokens)


def _assert_greedy_agrees(name: str, model, tokens: list[list[int]], ref_tokens: list[list[int]]) -> None:
    """Equal greedy tokens; with dynamic (per-token) activation scales, kiln's tokens near-greedy under the
    reference instead (_greedy_gaps)."""
    if CASES[name]["qformat"] in ("fp8_dynamic", "int8_dynamic"):
        assert max(_greedy_gaps(model, tokens)) < 0.1, (tokens, ref_tokens)
    else:
        assert tokens == ref_tokens


def _greedy_gaps(model, outputs: list[list[int]]) -> list[float]:
    """For each of kiln's greedy tokens, how far its logit under the reference (fed kiln's tokens so far)
    falls below the reference's best. With activations quantized per token, a float32 sum one ulp apart
    (transformers' order against kiln's) can move an activation to the neighbouring FP8/INT8 value, 6% away
    for FP8: the next logits move by a few hundredths on these random models, and an argmax that close may
    flip (seen with transformers 5.24, not 5.23). A wrong kernel moves them by far more than 0.1."""
    gaps = []
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outputs):
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()  # [new, V]
            gaps += (logits.max(-1).values - logits.gather(-1, torch.tensor(out)[:, None])[:, 0]).tolist()
    return gaps


def _worst(logprobs: list[list[float]], ref: list[list[float]]) -> float:
    return max(abs(a - b) for row, ref_row in zip(logprobs, ref) for a, b in zip(row, ref_row, strict=True))


# transformers 5.23 with compressed-tensors 0.20 loads packed zero points into [N, groups] parameters, finds
# [ceil(N * bits / 32), groups] in the checkpoint and re-initializes them ("MISMATCH ... Reinit due to size
# mismatch" in its load report); see vllm-project/llm-compressor#1618.
_HF_ZERO_POINTS = pytest.mark.xfail(reason="transformers re-initializes packed weight_zero_point on loading",
                                    strict=False)
# transformers 5.24 with compressed-tensors 0.20 loads kv_cache_scheme but no longer fake-quantizes the KV cache:
# its outputs equal this file's reference without the FP8 KV step exactly (checked), kiln's keep the step.
_HF_NO_KV_QUANT = pytest.mark.xfail(reason="transformers 5.24 does not fake-quantize the KV cache", strict=False)
HF_CASES = [pytest.param(name, marks=_HF_ZERO_POINTS) if CASES[name].get("zero_point")
            else pytest.param(name, marks=_HF_NO_KV_QUANT) if name == "fp8_kv" else name for name in CASES]


@pytest.mark.parametrize("name", HF_CASES)
def test_engine_matches_transformers_loading_the_checkpoint(engines, name):
    """transformers' compressed-tensors integration dequantizes the weights and fake-quantizes activations and the
    KV cache itself. It agrees with kiln everywhere but INT8 per-token activations, which compressed-tensors
    scales by amax / 127.5 where kiln (as vLLM) takes amax / 127: there it is the reference with 127.5 exactly,
    and kiln is the same model a rounding of every activation away."""
    pytest.importorskip("compressed_tensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    hf_tokens, hf_logprobs = _reference_outputs(model)
    tokens, logprobs = _kiln_outputs(engines(name))
    if name == "w8a8_int8":
        _, ref_logprobs = _reference_outputs(reference_model(FIXTURES / name, int8_token_qmax=127.5))
        assert _worst(hf_logprobs, ref_logprobs) < 1e-5
        assert _worst(logprobs, hf_logprobs) < 0.1
    else:
        _assert_greedy_agrees(name, model, tokens, hf_tokens)
        assert _worst(logprobs, hf_logprobs) < 2e-4


def test_unpack_matches_compressed_tensors_packing():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 72), generator=g, dtype=torch.int8)
        packed = ct.pack_to_int32(codes, bits)  # 72 columns: a partial last word
        assert torch.equal(unpack_int32(packed, bits, 72), codes)
        assert torch.equal(_unpack_bytes(packed, bits, 72).to(torch.int8), codes)


# --- checkpoints edited in a temporary copy -------------------------------------------------------------------

def _copy(name: str, tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    if edit_config is not None:
        raw = json.loads((path / "config.json").read_text())
        edit_config(raw["quantization_config"])
        (path / "config.json").write_text(json.dumps(raw))
    if edit_tensors is not None:
        tensors = load_file(path / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


def test_regex_ignore_entries_select_the_same_layers(engines, tmp_path):
    def regexes(qc):
        qc["ignore"] = ["re:.*lm_head$", r"re:model\.layers\.1\.self_attn\.[qkv]_proj$", r"re:.*layers\.0\.mlp\.down"]

    engine = _build(_copy("w4a16", tmp_path, regexes), tmp_path / "engine")
    assert load_engine_spec(engine).build_config["quantization"]["exclude_modules"] == W4A16_EXCLUDED
    assert _kiln_outputs(engine) == _kiln_outputs(engines("w4a16"))


def test_a_fused_layer_takes_the_largest_static_input_scale_of_its_parts(tmp_path):
    def larger_k(tensors):
        tensors["model.layers.0.self_attn.k_proj.input_scale"] = tensors["model.layers.0.self_attn.k_proj.input_scale"] * 3

    checkpoint = _copy("fp8", tmp_path, edit_tensors=larger_k)
    engine = load_file(next(_build(checkpoint, tmp_path / "engine").glob("*.safetensors")))
    source = load_file(checkpoint / "model.safetensors")
    part = "model.layers.0.self_attn.{}_proj.{}".format
    assert engine["model.layers.0.self_attn.qkv_proj.input_scale"] == source[part("k", "input_scale")]
    assert source[part("k", "input_scale")] > source[part("q", "input_scale")]
    # Per-tensor weight scales stay each part's own, on its rows: q 64, k 32, v 32.
    expected = torch.cat([source[part(p, "weight_scale")].expand(rows) for p, rows in (("q", 64), ("k", 32), ("v", 32))])
    assert torch.equal(engine["model.layers.0.self_attn.qkv_proj.weight_scale"], expected)
    assert torch.equal(engine["model.layers.0.self_attn.qkv_proj.weight"].view(torch.uint8),
                       torch.cat([source[part(p, "weight")] for p in "qkv"]).view(torch.uint8))


def test_a_module_ignored_in_every_layer_is_one_exclude_pattern(engines, tmp_path):
    """layer 1's down_proj stored in float too (its dequantized weight): both layers' down_proj excluded."""
    down = "model.layers.1.mlp.down_proj"

    def float_down(tensors):
        weights = json.loads((FIXTURES / "w4a16" / "config.json").read_text())["quantization_config"]
        tensors[f"{down}.weight"] = _dequantized(down, tensors, _weights(weights))
        for t in ("weight_packed", "weight_scale", "weight_shape"):
            del tensors[f"{down}.{t}"]

    checkpoint = _copy("w4a16", tmp_path, lambda qc: qc["ignore"].append(down), float_down)
    engine = _build(checkpoint, tmp_path / "engine")
    assert load_engine_spec(engine).build_config["quantization"]["exclude_modules"] == [
        "model.layers.*.mlp.down_proj", "model.layers.1.self_attn.qkv_proj", "lm_head"]
    tokens, logprobs = _kiln_outputs(engine)
    ref_tokens, ref_logprobs = _reference_outputs(reference_model(checkpoint))
    assert tokens == ref_tokens and _worst(logprobs, ref_logprobs) < 2e-4


def _refused(checkpoint: Path, tmp_path: Path, match: str, **options) -> None:
    with pytest.raises(BuildError, match=match):
        _build(checkpoint, tmp_path / "engine", **options)
    assert not (tmp_path / "engine").exists()


def test_unknown_num_bits_is_refused_naming_the_field(tmp_path):
    checkpoint = _copy("w4a16", tmp_path, lambda qc: _weights(qc).update(num_bits=3))
    _refused(checkpoint, tmp_path, r"config_groups\.group_0: weights\.type='int' num_bits=3 weight-only has no kiln "
                                   r"scheme; kiln reads: .*INT4 / INT8 weight-only")


def test_an_ignore_list_splitting_q_k_v_is_refused(tmp_path):
    """k_proj of layer 0 left in float (as llm-compressor saves an ignored module), q and v quantized."""
    k = "model.layers.0.self_attn.k_proj"

    def float_k(tensors):
        tensors[f"{k}.weight"] = tensors[f"{k}.weight"].float() * tensors.pop(f"{k}.weight_scale").float()

    checkpoint = _copy("fp8_dynamic", tmp_path, lambda qc: qc["ignore"].append(k), float_k)
    _refused(checkpoint, tmp_path, r"ignore leaves model\.layers\.0\.self_attn\.k_proj unquantized but not the rest "
                                   r"of model\.layers\.0\.self_attn\.qkv_proj")


@pytest.mark.parametrize("flags, shown", [(dict(qformat="fp8"), "--qformat fp8"),
                                          (dict(kv_cache_dtype="fp8"), "--kv-cache-dtype fp8")])
def test_quantization_flags_are_refused_for_a_compressed_tensors_checkpoint(tmp_path, flags, shown):
    _refused(FIXTURES / "w4a16", tmp_path, rf"already quantized \(compressed-tensors 0\.19\.0 pack-quantized: int4 per group of 32 "
                                           rf"weights, unquantized activations\); "
                                           rf"{shown} would quantize it again", **flags)


def _two_groups(qc):
    second = json.loads(json.dumps(qc["config_groups"]["group_0"]))
    second["weights"]["group_size"] = 64
    qc["config_groups"]["group_0"]["targets"] = [r"re:.*self_attn.*"]
    qc["config_groups"]["group_1"] = {**second, "targets": [r"re:.*mlp.*"]}


@pytest.mark.parametrize("edit, match", [
    (_two_groups, r"config_groups: group_0 \(weight_only: int4 per group of 32\) and group_1 \(weight_only: int4 per "
                  r"group of 64\) quantize layers differently"),
    (lambda qc: _weights(qc).update(actorder="group"), r"weights\.actorder='group' \(a g_idx per input column\)"),
    (lambda qc: _weights(qc).update(strategy="tensor", group_size=None), r"weight-only weights\.strategy='tensor' has "
                                                                         r"no kiln scheme"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head"}),
     r"kv_cache_scheme \(float8 per attn_head\) is not one kiln reads"),
    (lambda qc: qc.update(format="marlin-24", config_groups={
        "group_0": {**qc["config_groups"]["group_0"], "format": None}}), r"format='marlin-24' is not a compressed-"
                                                                         r"tensors layout kiln reads"),
    (lambda qc: qc["ignore"].remove("model.layers.0.mlp.down_proj"),
     r"quantizes model\.layers\.0\.mlp\.down_proj \(targets\), but the checkpoint stores it unquantized"),
    (lambda qc: qc.update(transform_config={"config_groups": {"u": {}}}), r"transform_config is set"),
])
def test_schemes_kiln_cannot_build_exactly_are_refused(tmp_path, edit, match):
    _refused(_copy("w4a16", tmp_path, edit), tmp_path, match)


def test_quantized_tensors_no_config_field_accounts_for_are_refused(tmp_path):
    def kv_scales(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.ones(1)

    _refused(_copy("fp8_dynamic", tmp_path, edit_tensors=kv_scales), tmp_path,
             r"holds model\.layers\.0\.self_attn\.k_scale, which kiln would not read")


def test_w8a8_activation_schemes_without_a_kiln_engine_are_refused(tmp_path):
    def asymmetric(qc):
        qc["config_groups"]["group_0"]["input_activations"]["symmetric"] = False

    _refused(_copy("w8a8_int8", tmp_path, asymmetric), tmp_path,
             r"input_activations\.symmetric=false \(activation zero points\) has no kiln scheme")


def test_fp8_blocks_straddling_fused_parts_are_refused(tmp_path):
    """48-row blocks: q_proj's 64 rows end inside a block that k_proj's rows would share."""
    def blocks_of_48(qc):
        _weights(qc)["block_structure"] = [48, 32]

    _refused(_copy("fp8_block", tmp_path, blocks_of_48), tmp_path,
             r"model\.layers\.0\.self_attn\.qkv_proj: its part model\.layers\.0\.self_attn\.q_proj has 64 rows, not a "
             r"multiple of the 48-row weight block")

"""Pre-quantized checkpoints made by the real producer, NVIDIA ModelOpt (`mtq.quantize` +
`export_hf_checkpoint`), built by `kiln build --checkpoint` alone and compared with a float32 reference
that this test computes from the format's definition: the exported weights dequantized by hand, and
each linear's input quantized the way the format says (transformers loads these files but ignores the
scales). On the bundled model, the engine's perplexity equals ModelOpt's own fake-quantized model's."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from model_factory import hf_perplexity, make_checkpoint
from safetensors.torch import load_file

from kiln.bench.perplexity import perplexity
from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

mtq = pytest.importorskip("modelopt.torch.quantization")
export = pytest.importorskip("modelopt.torch.export")
from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 1, 44, 9], [120, 121, 122, 123, 124, 125, 126, 127]]
SMALL = BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=16, max_seq_len=128, kv_block_size=8)
FP8_MAX = 448.0


def _config(name: str, kv: bool = False, group: int = 32) -> dict:
    cfg = copy.deepcopy(getattr(mtq, name))
    if kv:
        cfg["quant_cfg"] += mtq.FP8_KV_CFG["quant_cfg"]
    for entry in cfg["quant_cfg"]:
        if name == "INT4_AWQ_CFG" and entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"] = {-1: group, "type": "static"}
    return cfg


def _export(model, cfg: dict, samples: list[list[int]], out: Path, keep_fake_quant: bool = False):
    """Calibrates `model` with ModelOpt and exports it to `out`. With keep_fake_quant, also returns a copy of the
    fake-quantized model as the export sees it (q/k/v and gate/up resmoothed to one AWQ scale, by ModelOpt's
    own `requantize_resmooth_fused_llm_layers`): the export turns `model`'s weights into low-precision codes."""

    def loop(m):
        with torch.no_grad():
            for s in samples:
                m(torch.tensor([s]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, loop)
        fake = None
        if keep_fake_quant:
            fake = copy.deepcopy(model)
            requantize_resmooth_fused_llm_layers(fake)
        export.export_hf_checkpoint(model, dtype=torch.float32, export_dir=out)
    return (out, fake) if keep_fake_quant else out


def _unpack_awq_rows(packed: torch.Tensor) -> torch.Tensor:
    # ModelOpt packs rows 2i (low nibble) and 2i+1 (high nibble) of signed int4 values.
    low, high = (packed & 0xF).int(), (packed >> 4).int()
    rows = torch.stack([low, high], 1).reshape(-1, packed.shape[1])
    return torch.where(rows >= 8, rows - 16, rows).float()


class _QuantizedInput:
    """A forward pre-hook: the linear's input as the format quantizes it (smoothing included)."""

    def __init__(self, kind: str, scale: torch.Tensor | None, pqs: torch.Tensor | None) -> None:
        self.kind, self.scale, self.pqs = kind, scale, pqs

    def __call__(self, module, args):
        x = args[0].float()
        if self.pqs is not None:
            x = x * self.pqs
        if self.kind == "none":
            return (x,)
        qmax = FP8_MAX if self.kind.startswith("fp8") else 127.0
        s = self.scale if self.scale is not None else x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
        if self.kind.startswith("fp8"):
            q = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        else:
            q = torch.round(x / s).clamp(-128, 127)
        return (q * s,)


def _reference(checkpoint: Path, algo: str) -> transformers.PreTrainedModel:
    """transformers' model of `checkpoint` with every quantized linear dequantized by hand."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config.quantization_config = None
    model = transformers.LlamaForCausalLM(config).float().eval()
    own = model.state_dict()
    plain = {k: v for k, v in tensors.items() if k in own and v.shape == own[k].shape and v.is_floating_point()
             and v.dtype != torch.float8_e4m3fn}
    model.load_state_dict(plain, strict=False)
    kinds = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8_dynamic", "W8A8_SQ_PER_CHANNEL": "int8",
             "W4A16_AWQ": "none"}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or f"{name}.weight_scale" not in tensors:
            continue
        w, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"].float()
        if algo == "W4A16_AWQ":
            group = w.shape[1] // s.shape[1]
            deq = _unpack_awq_rows(w) * s.repeat_interleave(group, 1)
        else:
            deq = w.float() * (s[:, None] if s.dim() == 1 else s)
        module.weight.data = deq
        scale = tensors.get(f"{name}.input_scale")
        module.register_forward_pre_hook(_QuantizedInput(kinds[algo], None if scale is None else scale.float(),
                                                         tensors.get(f"{name}.pre_quant_scale")))
    return model


def _kiln_prompt_logprobs(engine: Path, prompts: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True)
    return [out.prompt_logprobs[1:] for out in LLM(engine).generate(prompts, params)]


def _reference_prompt_logprobs(model, prompts: list[list[int]]) -> list[list[float]]:
    result = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        result.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mo") / "src")


@pytest.mark.parametrize("name, kv, algo", [("FP8_DEFAULT_CFG", False, "FP8"),
                                            ("FP8_PER_CHANNEL_PER_TOKEN_CFG", False, "FP8_PER_CHANNEL_PER_TOKEN"),
                                            ("INT8_SMOOTHQUANT_CFG", False, "W8A8_SQ_PER_CHANNEL"),
                                            ("INT4_AWQ_CFG", False, "W4A16_AWQ")])
def test_modelopt_exports_match_the_dequantized_reference(tiny, tmp_path, name, kv, algo):
    _, model = tiny
    samples = [[(i * 13 + j * 7) % 400 for j in range(24)] for i in range(4)]
    checkpoint = _export(copy.deepcopy(model), _config(name, kv), samples, tmp_path / "export")
    engine = build_engine(checkpoint, tmp_path / "engine", SMALL, progress=False)
    recorded = json.loads((engine / "engine.json").read_text())["build_config"]["quantization"]
    assert recorded["source"].startswith(f"ModelOpt {algo}")
    kiln = _kiln_prompt_logprobs(engine, PROMPTS)
    reference = _reference_prompt_logprobs(_reference(checkpoint, algo), PROMPTS)
    for k, r in zip(kiln, reference):
        assert max(abs(a - b) for a, b in zip(k, r)) < 2e-3, (k, r)


def test_a_modelopt_fp8_kv_cache_reads_its_scales(tiny, tmp_path):
    _, model = tiny
    samples = [[(i * 13 + j * 7) % 400 for j in range(24)] for i in range(4)]
    checkpoint = _export(copy.deepcopy(model), _config("FP8_DEFAULT_CFG", kv=True), samples, tmp_path / "export")
    engine = build_engine(checkpoint, tmp_path / "engine", SMALL, progress=False)
    build = json.loads((engine / "engine.json").read_text())["build_config"]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert build["kv_cache_dtype"] == "fp8"
    assert build["kv_cache_scales"][1] == [pytest.approx(tensors["model.layers.1.self_attn.k_proj.k_scale"].item()),
                                           pytest.approx(tensors["model.layers.1.self_attn.v_proj.v_scale"].item())]
    # Alone and batched: the same greedy tokens.
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(engine)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == \
        [llm.generate([p], params)[0].token_ids for p in PROMPTS]


def test_quantizing_a_quantized_checkpoint_again_is_refused(tiny, tmp_path):
    _, model = tiny
    checkpoint = _export(copy.deepcopy(model), _config("FP8_DEFAULT_CFG"), [[1, 2, 3, 4]], tmp_path / "export")
    with pytest.raises(BuildError, match=r"already quantized \(ModelOpt FP8 .*--qformat int4_awq would quantize it "
                                         r"again, which kiln does not offer"):
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(qformat="int4_awq"), progress=False)


def test_an_unknown_modelopt_algorithm_is_named(tiny, tmp_path):
    _, model = tiny
    checkpoint = _export(copy.deepcopy(model), _config("FP8_DEFAULT_CFG"), [[1, 2, 3, 4]], tmp_path / "export")
    hf = json.loads((checkpoint / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = "NVFP4"
    (checkpoint / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(BuildError, match=r"hf_quant_config.json: quantization.quant_algo='NVFP4' is not a ModelOpt "
                                         r"format kiln reads; kiln reads FP8, FP8_PER_CHANNEL_PER_TOKEN"):
        build_engine(checkpoint, tmp_path / "engine", SMALL, progress=False)
    assert not (tmp_path / "engine").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name, kv", [("FP8_DEFAULT_CFG", True), ("INT4_AWQ_CFG", False)])
def test_bundled_model_perplexity_equals_modelopts_own(tmp_path, name, kv):
    """kiln's engine of ModelOpt's export scores what ModelOpt's fake-quantized model scores (after the
    export, which resmooths q/k/v and gate/up to one AWQ scale each: what the checkpoint holds)."""
    source = EXAMPLES / "kiln-tiny-code"
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    text = (EXAMPLES / "heldout-sample.txt").read_text()
    ids = tokenizer.encode(text)
    calib = tokenizer.encode((Path(__file__).resolve().parent.parent / "kiln" / "quant" / "data" /
                              "calibration-sample.txt").read_text()[:40_000])
    samples = [calib[i:i + 256] for i in range(0, 256 * 12, 256)]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    checkpoint, fake = _export(model, _config(name, kv, group=128), samples, tmp_path / "export",
                               keep_fake_quant=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / f).write_bytes((source / f).read_bytes())
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dtype="float32"), progress=False)
    kiln = perplexity(LLM(engine, max_num_tokens=256), text)
    producer, _ = hf_perplexity(fake, ids, kiln.window_len)
    print(f"{name}: kiln {kiln.perplexity:.4f}, ModelOpt fake-quantized {producer:.4f}")
    assert abs(kiln.perplexity / producer - 1) < 0.01, (kiln.perplexity, producer)

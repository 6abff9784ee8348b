"""DeepSeek-V3 from a block-scaled FP8 checkpoint (quant_method "fp8", weight_block_size: the release format of
deepseek-ai/DeepSeek-V3): a tiny random V3 quantized here by test_fp8_block.py's reference block quantizer, built
by kiln and run against transformers on the weights dequantized, with the activations of the layers the engine
keeps in FP8 fake-quantized per token and group of b1 columns (test_fp8_block.py's code, written from the format's
definition). The engine keeps q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj, the dense MLP and the shared experts
in FP8 (the rope rows reordered within their blocks), dequantizes kv_b_proj and the routed experts, and leaves the
MTP layer unread. At TP=1 and TP=2 (gloo), with chunked prefill, long chunks taking MLA's explicit prefill.
Refusals by their messages.

The dims are small but fit the blocks of 32 rows as the engine needs them: every head's q rows (24 nope + 8 rope)
are one block, so the rope rows keep their block; the dense MLP's and shared experts' intermediate sizes (128, 64)
split over two ranks on whole blocks.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers
from model_factory import hf_greedy, hf_prompt_logprobs
from safetensors.torch import load_file, save_file
from test_fp8_block import _dequantize_by_blocks, _fake_quantize_activation, _quantize_weight_by_blocks
from test_models_deepseek import check_explicit_prefill, make_checkpoint

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import load_engine_spec
from kiln.model_defs import ModelConfigError, get_model_def
from kiln.runtime import LLM, SamplingParams

FP8 = torch.float8_e4m3fn
BLOCK = (32, 32)
V3 = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
          v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, first_k_dense_replace=1, num_hidden_layers=3,
          n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=True,
          routed_scaling_factor=2.5, num_nextn_predict_layers=1)
LIMITS = dict(dtype="float32", max_batch_size=8, max_num_tokens=128, max_seq_len=128)
PROMPTS = [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in (2, 5, 17, 40)]
NEW_TOKENS = 8
# The checkpoint's quantized linears: every projection of attention and MLP (routed, shared, dense), as V3's release.
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
                       r"o_proj)|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight")
# Those the engine keeps in FP8 (their inputs are quantized at run time); kv_b_proj and the routed experts are float.
ENGINE_FP8 = re.compile(r".*(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|o_proj)|"
                        r"mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))")
MTP = V3["num_hidden_layers"]


def _block_config(b0: int, b1: int) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [b0, b1]}


def _quantize_checkpoint(src, dst, block) -> dict[str, torch.Tensor]:
    """`src` copied to `dst` with every QUANTIZED weight block-quantized, an FP8 MTP layer added and
    quantization_config set; returns the new tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if QUANTIZED.fullmatch(n)]:
        w_q, scale = _quantize_weight_by_blocks(tensors[name], *block)
        tensors[name] = w_q
        tensors[f"{name.removesuffix('.weight')}.weight_scale_inv"] = scale
    for name in ("self_attn.kv_b_proj", "eh_proj"):  # V3's MTP layer, stored FP8 as in the release
        tensors[f"model.layers.{MTP}.{name}.weight"] = torch.zeros(64, 64, dtype=FP8)
        tensors[f"model.layers.{MTP}.{name}.weight_scale_inv"] = torch.ones(2, 2)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _block_config(*block)
    (dst / "config.json").write_text(json.dumps(config))
    return tensors


def _dequantized(tensors, name, block) -> torch.Tensor:
    return _dequantize_by_blocks(tensors[name], tensors[f"{name.removesuffix('.weight')}.weight_scale_inv"], *block)


def _reference(src, tensors, block, dst, layers: int = V3["num_hidden_layers"]) -> transformers.PreTrainedModel:
    """transformers' V3 on the dequantized weights, with the inputs of the engine's FP8 linears fake-quantized
    per token and group of b1 columns, as kiln's fp8_block_linear quantizes them."""
    shutil.copytree(src, dst)
    floats = load_file(dst / "model.safetensors")
    for name in floats:
        if QUANTIZED.fullmatch(name):
            floats[name] = _dequantized(tensors, name, block)
    save_file(floats, dst / "model.safetensors", metadata={"format": "pt"})
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ENGINE_FP8.fullmatch(name):
            module.register_forward_pre_hook(
                lambda m, args: (_fake_quantize_activation(args[0], block[1]).to(args[0].dtype),))
            hooked += 1
    # per layer: q_a and q_b (or q_proj), kv_a, o; layer 0 its dense MLP, the others their shared experts: 3 each
    assert hooked == (7 if model.config.q_lora_rank else 6) * layers
    return model


@pytest.fixture(scope="module")
def fp8_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-fp8")
    src, _ = make_checkpoint(root / "float", "DeepseekV3ForCausalLM", **V3)
    tensors = _quantize_checkpoint(src, root / "fp8", BLOCK)
    reference = _reference(src, tensors, BLOCK, root / "dequantized")
    engine = build_engine(root / "fp8", root / "engine", BuildConfig(**LIMITS), progress=False)
    return root, tensors, reference, engine


def _assert_logprobs_close(got: list[list[float]], want: list[list[float]]) -> None:
    """float32 rounding apart (about 1e-6), except after an activation that lies a hair from an FP8 rounding
    boundary rounds the other way in one of them (test_fp8_block.py). In a cached latent such a flip moves every
    later position of its prompt: measured once in the 40-token prompt, layer 1's q_a_proj / kv_a_proj_with_mqa
    input at position 3 is -23.00009 times its group's scale in kiln, the midpoint of FP8's 22 and 24, and its
    later positions then differ by 1e-3 to 2.5e-2 (mean 3.6e-3 over all 60 positions). The nearest wrong readings
    are off far more: per-token activation scales by 7e-2 on average and 0.6 at most, no activation quantization
    by 8.6e-2 and 0.8."""
    diffs = [abs(x - y) for xs, ys in zip(got, want, strict=True) for x, y in zip(xs, ys, strict=True)]
    assert max(diffs) < 5e-2, diffs
    assert sum(diffs) / len(diffs) < 1e-2, diffs


def _check_against_reference(llm: LLM, reference) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(reference, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    _assert_logprobs_close([o.prompt_logprobs[1:] for o in outputs], [hf_prompt_logprobs(reference, p) for p in PROMPTS])


def test_the_engine_keeps_fp8_linears_and_dequantizes_kv_b_proj_and_the_routed_experts(fp8_case):
    _, tensors, _, engine = fp8_case
    spec = load_engine_spec(engine)
    recorded = spec.build_config["quantization"]
    assert recorded["qformat"] == "fp8_block" and recorded["block_size"] == list(BLOCK)
    assert spec.model_config["mla"]["fp8_block_size"] == list(BLOCK)
    written = load_file(engine / "rank0.safetensors")
    for layer in range(V3["num_hidden_layers"]):
        attn = f"model.layers.{layer}.self_attn"
        for module in ("q_a_proj", "o_proj"):  # bit for bit: codes and scales
            assert torch.equal(written[f"{attn}.{module}.weight"].view(torch.uint8),
                               tensors[f"{attn}.{module}.weight"].view(torch.uint8))
            assert torch.equal(written[f"{attn}.{module}.weight_scale_inv"], tensors[f"{attn}.{module}.weight_scale_inv"])
        # the rope rows (the last 8 of each head's 32, the last 8 of kv_a's 40) reordered to halves in their block
        order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
        q = tensors[f"{attn}.q_b_proj.weight"].view(torch.uint8).view(4, 32, -1)
        q = torch.cat([q[:, :24], q[:, 24:][:, order]], dim=1).reshape(128, -1)
        assert torch.equal(written[f"{attn}.q_b_proj.weight"].view(torch.uint8), q)
        assert torch.equal(written[f"{attn}.q_b_proj.weight_scale_inv"], tensors[f"{attn}.q_b_proj.weight_scale_inv"])
        kv = tensors[f"{attn}.kv_a_proj_with_mqa.weight"].view(torch.uint8)
        assert torch.equal(written[f"{attn}.kv_a_proj_with_mqa.weight"].view(torch.uint8),
                           torch.cat([kv[:32], kv[32:][order]]))
        # absorbed: float, the checkpoint's blocks dequantized
        assert torch.equal(written[f"{attn}.kv_b_proj.weight"], _dequantized(tensors, f"{attn}.kv_b_proj.weight", BLOCK))
        assert f"{attn}.kv_b_proj.weight_scale_inv" not in written
    assert written["model.layers.0.mlp.gate_up_proj.weight"].dtype == FP8
    mlp = "model.layers.1.mlp"
    assert written[f"{mlp}.shared_experts.gate_up_proj.weight"].dtype == FP8
    assert written[f"{mlp}.shared_experts.down_proj.weight"].dtype == FP8
    gate_up = torch.stack([torch.cat([_dequantized(tensors, f"{mlp}.experts.{e}.{p}.weight", BLOCK)
                                      for p in ("gate_proj", "up_proj")]) for e in range(V3["n_routed_experts"])])
    assert torch.equal(written[f"{mlp}.experts.gate_up.weight"], gate_up)
    down = torch.stack([_dequantized(tensors, f"{mlp}.experts.{e}.down_proj.weight", BLOCK)
                        for e in range(V3["n_routed_experts"])])
    assert torch.equal(written[f"{mlp}.experts.down.weight"], down)
    for name in (f"{mlp}.gate.weight", f"{mlp}.gate.e_score_correction_bias", "lm_head.weight",
                 "model.embed_tokens.weight"):  # left unquantized by the checkpoint: passed through
        assert written[name].dtype == torch.float32 and torch.equal(written[name], tensors[name])
    assert not any(n.startswith(f"model.layers.{MTP}.") for n in written)


def test_greedy_tokens_and_logprobs_match_transformers_on_the_dequantized_weights(fp8_case):
    _, _, reference, engine = fp8_case
    with LLM(engine) as llm:
        _check_against_reference(llm, reference)


def test_chunked_prefill_matches_transformers(fp8_case):
    """A 16-token step budget cuts the prompts into chunks, several sequences a step."""
    _, _, reference, engine = fp8_case
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(engine, max_num_tokens=16, max_batch_size=4) as llm:
        outputs = llm.generate(PROMPTS[::-1], params)
    for prompt, p, out in zip(PROMPTS[::-1], params, outputs):
        assert out.token_ids == hf_greedy(reference, prompt, p.max_tokens), f"prompt of {len(prompt)} tokens"


def test_explicit_prefill_matches_transformers(fp8_case, monkeypatch, tmp_path):
    """A prompt in one step and a prefix-cached one in long chunks through MLA's explicit prefill."""
    _, _, reference, engine = fp8_case
    check_explicit_prefill(engine, reference, 1, monkeypatch, tmp_path, _assert_logprobs_close)


def test_tp2_matches_transformers(fp8_case, monkeypatch, tmp_path):
    """Heads split over two ranks on whole blocks (q_b_proj's 2 heads = 2 blocks of rows, o_proj's 32 input
    columns = 1 block), the shared experts' and dense MLP's intermediate features too; chunked prefill in short
    chunks (absorbed), then long ones (the explicit prefill) on both ranks."""
    root, _, reference, _ = fp8_case
    engine = build_engine(root / "fp8", root / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    with LLM(engine, max_num_tokens=16) as llm:
        _check_against_reference(llm, reference)
    check_explicit_prefill(engine, reference, 2, monkeypatch, tmp_path, _assert_logprobs_close)


def test_a_split_that_cuts_a_block_is_refused_by_name(fp8_case, tmp_path):
    """Blocks of 48 columns: o_proj's 64 input columns (4 heads of 16) are blocks [0, 48) and [48, 64), and rank
    1's half starts inside the first. (builder/sharding.py's generic check, named by layer, tensor, shape, tp.)"""
    root, _, _, _ = fp8_case
    _quantize_checkpoint(root / "float", tmp_path / "fp8", (32, 48))
    build_engine(tmp_path / "fp8", tmp_path / "tp1", BuildConfig(**LIMITS), progress=False)  # whole: fine
    with pytest.raises(BuildError, match=r"model\.layers\.0\.self_attn\.o_proj: cannot split weight_scale_inv "
                                         r"\[2, 2\] over --tp-size 2"):
        build_engine(tmp_path / "fp8", tmp_path / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    assert not (tmp_path / "tp2").exists()


def test_rope_rows_that_would_leave_their_block_are_refused(fp8_case, tmp_path):
    """Blocks of 12 rows: head 1's rope rows 56..63 straddle two blocks, so reordering them would change scales."""
    root, _, _, _ = fp8_case
    _quantize_checkpoint(root / "float", tmp_path / "fp8", (12, 16))
    with pytest.raises(BuildError, match=r"model\.layers\.0\.self_attn\.q_b_proj: the model reorders this layer's "
                                         r"rows at build .* another block of the checkpoint's weight_block_size rows "
                                         r"\(12\)"):
        build_engine(tmp_path / "fp8", tmp_path / "engine", BuildConfig(**LIMITS), progress=False)


def test_other_pre_quantized_formats_are_refused_by_name():
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, **V3}
    parse = get_model_def("DeepseekV3ForCausalLM").parse_config
    assert parse({**raw, "quantization_config": _block_config(128, 128)}).mla.fp8_block_size == (128, 128)
    for config, what in (({"quant_method": "fp8"}, r"fp8, no weight_block_size"), ({"quant_method": "awq"}, "awq")):
        with pytest.raises(ModelConfigError, match=rf"pre-quantized checkpoints \({what}\) are not supported with "
                                                   r"MLA; supported: block-scaled FP8"):
            parse({**raw, "quantization_config": config})
    with pytest.raises(ModelConfigError, match=r"weight_block_size=\[128\] must be two positive integers"):
        parse({**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})


def test_queries_without_low_rank_q_proj_stay_fp8(tmp_path):
    """q_lora_rank null (V2-Lite's shape): q_proj is FP8 in the engine, its rope rows reordered in their blocks."""
    overrides = {**V3, "q_lora_rank": None, "num_hidden_layers": 2}
    src, _ = make_checkpoint(tmp_path / "float", "DeepseekV3ForCausalLM", **overrides)
    tensors = _quantize_checkpoint(src, tmp_path / "fp8", BLOCK)
    engine = build_engine(tmp_path / "fp8", tmp_path / "engine", BuildConfig(**LIMITS), progress=False)
    written = load_file(engine / "rank0.safetensors")
    q = "model.layers.1.self_attn.q_proj"
    assert written[f"{q}.weight"].dtype == FP8 and f"{q}.weight_scale_inv" in written
    assert torch.equal(written[f"{q}.weight"][:24].view(torch.uint8), tensors[f"{q}.weight"][:24].view(torch.uint8))
    reference = _reference(src, tensors, BLOCK, tmp_path / "dequantized", layers=2)
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine) as llm:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(reference, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    _assert_logprobs_close([o.prompt_logprobs[1:] for o in outputs], [hf_prompt_logprobs(reference, p) for p in prompts])

"""`kiln build --tp-size N`: each rank's file holds its share of every tensor (checked by putting the shares
back together into the tp_size 1 engine's tensors), row-parallel biases once, the vocabulary padded; what
cannot be split fails before anything is written. Building only: no processes, no GPU, no loading."""

from __future__ import annotations

import json

import pytest
import torch
from model_factory import make_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file
from test_prequant_awq_gptq import write_quantized

from kiln.builder.build import BuildError, build_engine, load_model_config, param_specs
from kiln.builder.build_config import BuildConfig
from kiln.builder.safetensors_writer import SafetensorsStream, TensorSpec, write_safetensors_split
from kiln.builder.sharding import ShardingError, TensorCut, plan_sharding
from kiln.cli import main
from kiln.engine_format import Mapping, load_engine_spec
from kiln.quant.fp8_block import Fp8BlockConfig

SMALL = dict(dtype="float32", max_batch_size=4, max_num_tokens=16, max_seq_len=64, kv_block_size=8)
# BASE of model_factory: hidden 64, 4 heads of 16, intermediate 128, 2 layers.
HIDDEN, HEADS, INTER = 64, 4, 128


def _build(checkpoint, out, **options):
    return build_engine(checkpoint, out, BuildConfig(**SMALL, **options), progress=False)


def _engines(tmp_path, architecture="LlamaForCausalLM", tp=2, build=None, prequantize=None, **model):
    """(whole tensors of the tp_size 1 engine, each rank's tensors, the tp engine dir) for one tiny checkpoint
    (its biases random: transformers starts them at zero, which would hide a bias on the wrong rank), made
    a pre-quantized one by `prequantize(checkpoint, hf_model)`."""
    checkpoint, hf_model = make_checkpoint(tmp_path / "ckpt", architecture, **model)
    biases = [p for name, p in hf_model.named_parameters() if name.endswith(".bias")]
    if biases:
        with torch.no_grad():
            for bias in biases:
                bias.normal_()
        hf_model.save_pretrained(checkpoint)
    if prequantize is not None:
        prequantize(checkpoint, hf_model)
    build = build or {}
    whole = load_file(_build(checkpoint, tmp_path / "tp1", **build) / "rank0.safetensors")
    engine = _build(checkpoint, tmp_path / "tp", tp_size=tp, **build)
    ranks = [load_file(engine / f"rank{r}.safetensors") for r in range(tp)]
    return whole, ranks, engine


def _reassemble(shares: list[torch.Tensor], parts: int, dim: int) -> torch.Tensor:
    """The whole tensor from the ranks' shares of each of `parts` equal-per-rank parts ([q; k; v] or
    [gate; up] with equal k and v): part i of every rank in rank order, then part i + 1."""
    return torch.cat([torch.cat([share.tensor_split(parts, dim)[i] for share in shares], dim)
                      for i in range(parts)], dim)


def _check_column_row_and_norms(whole: dict, ranks: list[dict], tp: int, kv_heads: int = 2) -> None:
    """Every non-embedding tensor: qkv by head parts, gate_up by part, o/down along the input (bias on rank 0
    only), anything of the whole shape replicated. Quantized tensors too: their rows or groups follow the
    features, per-tensor scales and a column layer's pre_quant_scale are replicated."""
    for name, tensor in whole.items():
        shares = [rank[name] for rank in ranks]
        layer, attr = name.rsplit(".", 1)
        if all(s.shape == tensor.shape for s in shares):
            if attr == "bias" and layer.endswith(("o_proj", "down_proj")):
                assert torch.equal(shares[0], tensor) and all(not s.any() for s in shares[1:]), name
            else:
                assert all(torch.equal(s, tensor) for s in shares), name
        elif layer.endswith("qkv_proj"):
            kv = tensor.shape[0] * kv_heads // (HEADS + 2 * kv_heads)  # rows of k (and of v)
            q = tensor.shape[0] - 2 * kv
            pieces = [s.split([q // tp, kv // tp, kv // tp]) for s in shares]
            rebuilt = torch.cat([torch.cat([p[i] for p in pieces]) for i in range(3)])
            assert torch.equal(rebuilt, tensor), name
        elif layer.endswith("gate_up_proj"):
            assert torch.equal(_reassemble(shares, 2, 0), tensor), name
        elif layer.endswith(("o_proj", "down_proj")):  # along the input: the last dim
            assert torch.equal(torch.cat(shares, dim=-1), tensor), name
        else:
            assert name in ("model.embed_tokens.weight", "lm_head.weight"), name


def _check_vocab(whole: torch.Tensor, shares: list[torch.Tensor]) -> None:
    vocab, per_rank = whole.shape[0], -(-whole.shape[0] // len(shares))
    assert all(s.shape[0] == per_rank for s in shares)
    joined = torch.cat(shares)
    assert torch.equal(joined[:vocab], whole) and not joined[vocab:].any()  # padding rows are zeros


def test_shares_of_a_gqa_llama_put_back_together_are_the_whole_engine(tmp_path):
    whole, ranks, engine = _engines(tmp_path, vocab_size=401)  # odd: rank 1 gets one padding row
    assert all(list(rank) == list(whole) for rank in ranks)  # same names, same order
    attn = "model.layers.0.self_attn"
    assert ranks[0][f"{attn}.qkv_proj.weight"].shape == (32 + 16 + 16, HIDDEN)  # 2 of 4 q heads, 1 of 2 kv heads
    assert ranks[1][f"{attn}.o_proj.weight"].shape == (HIDDEN, 32)
    assert ranks[1]["model.layers.1.mlp.down_proj.weight"].shape == (HIDDEN, INTER // 2)
    assert ranks[0]["model.layers.1.mlp.gate_up_proj.weight"].shape == (INTER, HIDDEN)
    assert ranks[1]["model.embed_tokens.weight"].shape == (201, HIDDEN)
    _check_column_row_and_norms(whole, ranks, 2)
    _check_vocab(whole["model.embed_tokens.weight"], [r["model.embed_tokens.weight"] for r in ranks])
    _check_vocab(whole["lm_head.weight"], [r["lm_head.weight"] for r in ranks])
    for r in range(2):
        with safe_open(engine / f"rank{r}.safetensors", "pt") as f:
            assert f.metadata() == {"format": "pt", "kiln_rank": str(r)}


def test_one_kv_head_is_replicated_on_every_rank(tmp_path):
    whole, ranks, _ = _engines(tmp_path, num_key_value_heads=1)
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.qkv_proj.weight"
        q, k, v = whole[name].split([64, 16, 16])
        for r, rank in enumerate(ranks):
            assert torch.equal(rank[name], torch.cat([q[r * 32:(r + 1) * 32], k, v])), (name, r)


def test_row_parallel_biases_are_added_once_and_column_biases_split(tmp_path):
    whole, ranks, _ = _engines(tmp_path, attention_bias=True, mlp_bias=True)
    names = {n.rsplit(".", 2)[-2] for n in whole if n.endswith(".bias")}
    assert names == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert whole["model.layers.0.self_attn.o_proj.bias"].all()  # the zeros on rank 1 are the sharder's
    _check_column_row_and_norms(whole, ranks, 2)


def test_qwen2_qkv_bias_is_split_by_heads(tmp_path):
    whole, ranks, _ = _engines(tmp_path, "Qwen2ForCausalLM")
    name = "model.layers.0.self_attn.qkv_proj.bias"
    assert ranks[1][name].shape == (32 + 16 + 16,)
    assert "model.layers.0.self_attn.o_proj.bias" not in whole
    _check_column_row_and_norms(whole, ranks, 2)


def test_tied_embeddings_store_the_split_table_once(tmp_path):
    whole, ranks, _ = _engines(tmp_path, tie_word_embeddings=True, vocab_size=403, tp=4, num_key_value_heads=4)
    assert "lm_head.weight" not in whole and all("lm_head.weight" not in r for r in ranks)
    _check_vocab(whole["model.embed_tokens.weight"], [r["model.embed_tokens.weight"] for r in ranks])
    _check_column_row_and_norms(whole, ranks, 4, kv_heads=4)


def test_int4_groups_follow_their_features(tmp_path):
    whole, ranks, engine = _engines(tmp_path, build=dict(qformat="int4_wo", awq_block_size=32))
    o_proj = "model.layers.0.self_attn.o_proj"
    assert whole[f"{o_proj}.qweight"].dtype == torch.uint8
    assert ranks[1][f"{o_proj}.qweight"].shape == (HIDDEN, 32 // 2)  # 32 input features, two to a byte
    assert ranks[1][f"{o_proj}.scales"].shape == (HIDDEN, 1)  # one group of 32
    assert ranks[0]["model.layers.0.mlp.down_proj.zeros"].shape == (HIDDEN, 2)
    _check_column_row_and_norms(whole, ranks, 2)
    _check_vocab(whole["lm_head.weight"], [r["lm_head.weight"] for r in ranks])  # excluded: float
    assert load_engine_spec(engine).build_config["quantization"]["group_size"] == 32


@pytest.mark.parametrize("qformat", ["fp8", "int8_sq", "int4_awq", "int8_wo"])
def test_every_quantized_format_splits(tmp_path, qformat):
    # A short calibration (deterministic on the CPU): the same whole tensors for both builds.
    build = dict(qformat=qformat, awq_block_size=16, calib_size=2, calib_max_seq_len=16)
    whole, ranks, _ = _engines(tmp_path, build=build)
    _check_column_row_and_norms(whole, ranks, 2)


def test_a_prequantized_awq_checkpoint_splits(tmp_path):
    whole, ranks, _ = _engines(tmp_path, prequantize=lambda path, model: write_quantized(path, model, "awq"))
    assert ranks[1]["model.layers.0.mlp.down_proj.qweight"].shape == (HIDDEN, INTER // 2 // 2)
    _check_column_row_and_norms(whole, ranks, 2)


def test_gptq_act_order_is_refused_across_input_features(tmp_path):
    checkpoint, model = make_checkpoint(tmp_path / "ckpt")
    write_quantized(checkpoint, model, "gptq", act_order=True)
    with pytest.raises(BuildError, match=r"self_attn\.o_proj: cannot split g_idx over --tp-size 2: a GPTQ "
                                         r"act-order \(desc_act\) layer's g_idx"):
        _build(checkpoint, tmp_path / "engine", tp_size=2)
    assert not (tmp_path / "engine").exists()


def test_a_rank_that_would_cut_a_quantization_group_fails_before_writing(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(BuildError) as info:  # o_proj: 64 inputs, 32 per rank, groups of 64
        _build(checkpoint, tmp_path / "engine", tp_size=2, qformat="int4_wo", awq_block_size=64)
    message = str(info.value)
    assert "model.layers.0.self_attn.o_proj: cannot split scales [64, 1] over --tp-size 2" in message
    assert "one entry per 64 input features" in message and "[0, 32) would cut one" in message
    assert "--awq-block-size that divides 32" in message and "--tp-size for which 64 / tp_size" in message
    assert not (tmp_path / "engine").exists()


def test_heads_that_do_not_split_fail_naming_the_heads_and_the_flag(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(BuildError, match=r"--tp-size 3: num_attention_heads=4 is not divisible by tp_size=3"):
        _build(checkpoint, tmp_path / "engine", tp_size=3)
    assert not (tmp_path / "engine").exists()


def test_engine_json_records_the_mapping_and_every_rank_file(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    engine = _build(checkpoint, tmp_path / "engine", tp_size=2)
    spec = json.loads((engine / "engine.json").read_text())
    assert spec["mapping"] == {"tp_size": 2, "num_ranks": 2}
    loaded = load_engine_spec(engine)  # checks every listed file's size and sha256
    assert {"rank0.safetensors", "rank1.safetensors"} <= set(loaded.files)
    assert [loaded.rank_file(r).name for r in range(loaded.num_ranks)] == ["rank0.safetensors", "rank1.safetensors"]


def test_dummy_weights_are_cut_like_real_ones(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", attention_bias=True)
    whole = load_file(_build(checkpoint, tmp_path / "tp1", dummy_weights=True) / "rank0.safetensors")
    engine = _build(checkpoint, tmp_path / "tp2", dummy_weights=True, tp_size=2)
    _check_column_row_and_norms(whole, [load_file(engine / f"rank{r}.safetensors") for r in range(2)], 2)


def test_fp8_blocks_are_cut_by_whole_blocks(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    model_def, config = load_model_config(checkpoint)
    o_proj, qkv = "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"

    def plan(block):
        quant = Fp8BlockConfig(block)
        specs = param_specs(model_def, config, torch.float32, quant)
        return plan_sharding(model_def, config, quant, Mapping(tp_size=2), specs, dtype=torch.float32)

    sharder = plan((16, 16))
    assert sharder.cuts[1][f"{o_proj}.weight_scale_inv"] == TensorCut(1, ((2, 4),))  # blocks of 16 inputs
    assert sharder.cuts[1][f"{qkv}.weight_scale_inv"] == TensorCut(0, ((2, 4), (5, 6), (7, 8)))  # q, k, v rows
    # One block of 64 covers o_proj's 64 inputs, so both ranks' 32 use its scale.
    assert plan((16, 64)).cuts[1][f"{o_proj}.weight_scale_inv"] == TensorCut()
    # Blocks of 48 over 64 inputs: [2] scales whose halves are not the ranks' halves (rank 1 starts inside block 0).
    with pytest.raises(ShardingError, match=r"o_proj: cannot split weight_scale_inv \[4, 2\] over --tp-size 2: its 2 "
                                            r"entries along dim 1 do not grow in proportion"):
        plan((16, 48))


def test_build_prints_each_ranks_weights_and_kv_bytes(tmp_path, capsys):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--dtype", "float32",
                 "--tp-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "over 2 ranks (rank0 " in err and ", rank1 " in err
    assert "KV cache 256 bytes/token per rank (1 of 2 KV heads each; float32)" in err  # 2 layers x 1 x 16 x 2 x 4


def test_tp_size_must_be_a_positive_integer():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="tp_size"):
            BuildConfig(tp_size=bad)


def test_split_writer_produces_each_whole_tensor_once(tmp_path):
    calls = []

    def produce(spec):
        calls.append(spec.name)
        return torch.arange(6, dtype=torch.float32).reshape(2, 3)

    specs = [TensorSpec("a", torch.float32, (2, 3)), TensorSpec("b", torch.float32, (2, 3))]
    halves = [[TensorSpec(s.name, s.dtype, (1, 3)) for s in specs] for _ in range(2)]
    written = write_safetensors_split([tmp_path / "r0.safetensors", tmp_path / "r1.safetensors"], specs, halves,
                                      produce, lambda name, whole, i: whole[i:i + 1])
    assert calls == ["a", "b"] and [w.path.name for w in written] == ["r0.safetensors", "r1.safetensors"]
    assert torch.equal(load_file(tmp_path / "r1.safetensors")["b"], torch.tensor([[3.0, 4.0, 5.0]]))
    with pytest.raises(ValueError, match="'a'"):  # a cut of the wrong shape: no file, no partial file left
        write_safetensors_split([tmp_path / "x0.safetensors"], specs, [halves[0]], produce,
                                lambda name, whole, i: whole)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0.safetensors", "r1.safetensors"]


def test_a_stream_holds_exactly_its_header_tensors(tmp_path):
    specs = [TensorSpec("a", torch.float32, (1,)), TensorSpec("b", torch.float32, (1,))]
    with SafetensorsStream(tmp_path / "s.safetensors", specs) as stream:
        stream.add(torch.ones(1))
        with pytest.raises(ValueError, match="1 of 2 tensors were never added, the first 'b'"):
            stream.finish()
        stream.add(torch.ones(1))
        with pytest.raises(ValueError, match="one more was added"):
            stream.add(torch.ones(1))
    assert list(tmp_path.iterdir()) == []  # left without finish: the partial file is gone

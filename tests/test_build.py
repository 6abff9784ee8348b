"""`build_engine`: every checkpoint layout, the engine directory it writes, fusion, dtypes, dummy weights,
and the errors (with no half-built output left behind)."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers
from model_factory import hf_greedy, make_checkpoint
from safetensors.torch import load_file, save_file

import kiln
from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

PROMPT = "the cat"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SMALL = BuildConfig(max_batch_size=4, max_num_tokens=64, max_seq_len=128, kv_block_size=8)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SUPPORTED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
             "GptOssForCausalLM", "GraniteForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
             "MixtralForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
             "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM", "Starcoder2ForCausalLM")


def build(checkpoint, output, **overrides):
    return build_engine(checkpoint, output, dataclasses.replace(SMALL, **overrides), progress=False)


def greedy_ids(engine_dir, prompt_ids):
    return LLM(engine_dir).generate(prompt_ids, GREEDY)[0].token_ids


def copy_config_and_tokenizer(src, dst):
    dst.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy2(src / name, dst / name)
    return dst


def save_bin(path, model, num_shards):
    """PyTorch .bin weights (transformers 5 no longer writes them): one file, or shards plus an index."""
    for stale in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        stale.unlink()
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if num_shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        file = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        shard = names[i::num_shards]
        torch.save({n: state[n] for n in shard}, path / file)
        weight_map.update(dict.fromkeys(shard, file))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class Base(NamedTuple):
    """One tiny float32 Llama checkpoint and transformers' greedy answer to PROMPT."""

    checkpoint: Path
    model: transformers.PreTrainedModel
    prompt_ids: list[int]
    hf_tokens: list[int]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    checkpoint, model = make_checkpoint(tmp_path_factory.mktemp("base") / "ckpt")
    prompt_ids = transformers.AutoTokenizer.from_pretrained(str(checkpoint)).encode(PROMPT)
    return Base(checkpoint, model, prompt_ids, hf_greedy(model, prompt_ids, GREEDY.max_tokens))


@pytest.fixture(scope="module")
def engine(base, tmp_path_factory):
    return build(base.checkpoint, tmp_path_factory.mktemp("engine") / "engine")


# -- checkpoint layouts ---------------------------------------------------------------------------


def single_safetensors(path, base):
    shutil.copy2(base.checkpoint / "model.safetensors", path / "model.safetensors")


def sharded_safetensors(path, base):
    base.model.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2


def single_bin(path, base):
    save_bin(path, base.model, num_shards=1)


def sharded_bin(path, base):
    save_bin(path, base.model, num_shards=3)


@pytest.mark.parametrize("layout", [single_safetensors, sharded_safetensors, single_bin, sharded_bin],
                         ids=lambda f: f.__name__)
def test_each_checkpoint_layout_builds_an_engine_that_matches_hf(layout, base, tmp_path):
    checkpoint = copy_config_and_tokenizer(base.checkpoint, tmp_path / "ckpt")
    layout(checkpoint, base)
    has_safetensors = any(checkpoint.glob("*.safetensors"))
    assert has_safetensors == ("safetensors" in layout.__name__)
    llm = LLM(build(checkpoint, tmp_path / "engine"))
    out = llm.generate(PROMPT, GREEDY)[0]
    assert out.prompt_token_ids == base.prompt_ids
    assert out.token_ids == base.hf_tokens


# -- the engine directory -------------------------------------------------------------------------


def test_engine_json_records_the_build(engine):
    doc = json.loads((engine / "engine.json").read_text())
    assert doc["format_version"] == 1
    assert doc["kiln_version"] == kiln.__version__
    assert doc["architecture"] == "LlamaForCausalLM"
    model_config = doc["model_config"]
    assert model_config["architecture"] == "LlamaForCausalLM"
    assert (model_config["vocab_size"], model_config["hidden_size"], model_config["intermediate_size"]) == (400, 64, 128)
    assert (model_config["num_layers"], model_config["num_heads"], model_config["num_kv_heads"]) == (2, 4, 2)
    assert model_config["head_dim"] == 16 and model_config["tie_word_embeddings"] is False
    assert model_config["eos_token_ids"] == [1] and model_config["bos_token_id"] == 0
    build_config = doc["build_config"]
    assert build_config["dtype"] == "float32"  # auto, from the float32 checkpoint
    assert {k: build_config[k] for k in ("max_batch_size", "max_num_tokens", "max_seq_len", "kv_block_size")} == {
        "max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 128, "kv_block_size": 8}
    assert build_config["kv_cache_dtype"] == "float32" and build_config["quantization"] is None
    assert doc["mapping"] == {"tp_size": 1, "num_ranks": 1}
    assert doc["target"]["device_type"] == "cpu"
    assert doc["target"]["torch_version"] == torch.__version__


def test_max_seq_len_defaults_to_max_position_embeddings(base, tmp_path):
    engine = build(base.checkpoint, tmp_path / "engine", max_seq_len=None)
    assert json.loads((engine / "engine.json").read_text())["build_config"]["max_seq_len"] == 256


def test_manifest_lists_every_file_with_its_size_and_sha256(engine):
    files = json.loads((engine / "engine.json").read_text())["files"]
    on_disk = {p.relative_to(engine).as_posix() for p in engine.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"engine.json"}
    assert {"rank0.safetensors", *(f"tokenizer/{n}" for n in TOKENIZER_FILES)} <= set(files)
    for rel, entry in files.items():
        data = (engine / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel


def test_tokenizer_folder_is_a_copy_of_the_checkpoints(base, engine):
    for name in TOKENIZER_FILES:
        assert (engine / "tokenizer" / name).read_bytes() == (base.checkpoint / name).read_bytes(), name
    assert not any(engine.glob("*.partial")) and not any(engine.parent.glob(".*.partial"))


# -- fusion ---------------------------------------------------------------------------------------


def test_rank0_holds_fused_qkv_and_gate_up_and_every_other_weight(base, engine):
    hf = base.model.state_dict()
    weights = load_file(str(engine / "rank0.safetensors"))
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = torch.cat([hf[f"{attn}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
        assert qkv.shape == (64 + 2 * 32, 64)
        torch.testing.assert_close(weights[f"{attn}.qkv_proj.weight"], qkv, rtol=0, atol=0)
        gate_up = torch.cat([hf[f"{mlp}.gate_proj.weight"], hf[f"{mlp}.up_proj.weight"]])
        torch.testing.assert_close(weights[f"{mlp}.gate_up_proj.weight"], gate_up, rtol=0, atol=0)
    fused_parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    unfused = {n for n in hf if not any(f".{p}." in n for p in fused_parts)}
    assert set(weights) == unfused | {f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")}
    for name in unfused:
        torch.testing.assert_close(weights[name], hf[name], rtol=0, atol=0, msg=name)


def test_tied_embeddings_store_no_lm_head(base, tmp_path):
    checkpoint, model = make_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    engine = build(checkpoint, tmp_path / "engine")
    weights = load_file(str(engine / "rank0.safetensors"))
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    assert json.loads((engine / "engine.json").read_text())["model_config"]["tie_word_embeddings"] is True
    assert greedy_ids(engine, base.prompt_ids) == hf_greedy(model, base.prompt_ids, 8)


# -- dtypes ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", dtype=torch.bfloat16)


@pytest.mark.parametrize(("requested", "expected"), [("auto", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_auto_follows_the_checkpoint_and_explicit_dtype_overrides(bf16_checkpoint, tmp_path, requested,
                                                                          expected, monkeypatch):
    # On a CPU that computes bfloat16 natively (tests/test_resolve_dtype.py covers the others).
    monkeypatch.setattr("kiln.builder.build.cpu_flags", lambda *args: frozenset({"avx512_bf16"}))
    checkpoint, model = bf16_checkpoint
    engine = build(checkpoint, tmp_path / "engine", dtype=requested)
    name = str(expected).removeprefix("torch.")
    build_config = json.loads((engine / "engine.json").read_text())["build_config"]
    assert (build_config["dtype"], build_config["kv_cache_dtype"]) == (name, name)
    weights = load_file(str(engine / "rank0.safetensors"))
    assert {t.dtype for t in weights.values()} == {expected}
    hf_embed = model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(weights["model.embed_tokens.weight"], hf_embed.to(expected))
    assert len(greedy_ids(engine, [0, 5, 9])) == 8


# -- dummy weights --------------------------------------------------------------------------------


def test_dummy_weights_need_only_config_json(base, tmp_path):
    checkpoint = tmp_path / "config_only"
    checkpoint.mkdir()
    config = json.loads((base.checkpoint / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):  # no dtype named: auto means float32
        config.pop(key, None)
    (checkpoint / "config.json").write_text(json.dumps(config))
    engine = build(checkpoint, tmp_path / "engine", dummy_weights=True)

    doc = json.loads((engine / "engine.json").read_text())
    assert doc["build_config"]["dummy_weights"] is True and doc["build_config"]["dtype"] == "float32"
    assert set(doc["files"]) == {"rank0.safetensors"} and not (engine / "tokenizer").exists()
    llm = LLM(engine)
    out = llm.generate([0, 5, 9], GREEDY)[0]
    assert out.prompt_token_ids == [0, 5, 9] and len(out.token_ids) == 8
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(PROMPT, GREEDY)
    # Same seed, same weights: benchmarks of two dummy builds compare like with like.
    again = build(checkpoint, tmp_path / "again", dummy_weights=True)
    assert json.loads((again / "engine.json").read_text())["files"] == doc["files"]


# -- errors ---------------------------------------------------------------------------------------


def _edit_config(**changes):
    def edit(checkpoint, base):
        config = json.loads((checkpoint / "config.json").read_text())
        config.update(changes)
        (checkpoint / "config.json").write_text(json.dumps(config))
    return edit


def _drop_tensor(checkpoint, base=None):
    weights = load_file(str(checkpoint / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


def _remove_weights(checkpoint, base):
    (checkpoint / "model.safetensors").unlink()


def _misplace_in_index(checkpoint, base):
    sharded_safetensors(checkpoint, base)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    weight_map["model.layers.0.mlp.up_proj.weight"] = weight_map["model.embed_tokens.weight"]
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))


def _corrupt_shard(checkpoint, base):
    sharded_safetensors(checkpoint, base)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    (checkpoint / index["weight_map"]["model.norm.weight"]).write_bytes(b"\xff" * 64)


BROKEN_CHECKPOINTS = {
    "missing_config": (lambda c, _: (c / "config.json").unlink(), r"config\.json .*does not exist"),
    "invalid_json": (lambda c, _: (c / "config.json").write_text("{not json"), r"cannot read config .*config\.json"),
    "unsupported_architecture": (_edit_config(architectures=["GPT2LMHeadModel"]),
                                 r"'GPT2LMHeadModel' is not supported; supported: " + ", ".join(SUPPORTED)),
    "no_architectures": (_edit_config(architectures=None), "no 'architectures' list"),
    "hidden_act": (_edit_config(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    "missing_tensor": (_drop_tensor, r"lacks tensors the model needs: model\.layers\.1\.mlp\.up_proj\.weight"),
    "config_does_not_match_weights": (_edit_config(intermediate_size=96),
                                      r"gate_up_proj\.weight of shape \[192, 64\].*does config\.json belong"),
    "no_weight_files": (_remove_weights, "has no weight files"),
    # Index and shard problems surface while checking shapes, before any tensor is read.
    "index_names_wrong_shard": (_misplace_in_index, r"index says tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"),
    "corrupt_shard": (_corrupt_shard, r"safetensors file .*model-\d+-of-\d+\.safetensors is corrupt"),
}


def assert_nothing_left(output):
    assert not output.exists()
    assert not list(output.parent.glob(f".{output.name}*")), "a staging directory was left behind"


@pytest.mark.parametrize("case", BROKEN_CHECKPOINTS)
def test_broken_checkpoint_fails_naming_the_problem_and_leaves_nothing(case, base, tmp_path):
    break_it, message = BROKEN_CHECKPOINTS[case]
    checkpoint = shutil.copytree(base.checkpoint, tmp_path / "ckpt")
    break_it(checkpoint, base)
    output = tmp_path / "out" / "engine"
    with pytest.raises(BuildError, match=message):
        build(checkpoint, output)
    assert_nothing_left(output)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(BuildError, match=r"checkpoint directory .*nowhere does not exist"):
        build(tmp_path / "nowhere", tmp_path / "engine")
    assert_nothing_left(tmp_path / "engine")


def test_output_that_is_a_non_engine_directory_is_refused_and_kept(base, tmp_path):
    output = tmp_path / "my_files"
    output.mkdir()
    (output / "notes.txt").write_text("keep me")
    with pytest.raises(BuildError, match=r"my_files is a non-empty directory that is not an engine"):
        build(base.checkpoint, output)
    assert [p.name for p in output.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.glob(".my_files*"))


def test_output_that_is_a_file_is_refused(base, tmp_path):
    output = tmp_path / "engine"
    output.write_text("x")
    with pytest.raises(BuildError, match="exists and is not a directory"):
        build(base.checkpoint, output)
    assert output.read_text() == "x"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_target_without_cuda(base, tmp_path):
    with pytest.raises(BuildError, match="no CUDA device"):
        build(base.checkpoint, tmp_path / "engine", device="cuda")
    assert_nothing_left(tmp_path / "engine")


def test_rebuild_replaces_an_existing_engine(base, tmp_path):
    output = build(base.checkpoint, tmp_path / "engine")
    # A rank file an older build with more ranks left: the engine's kind of file, so it goes with the engine
    # (a file of any other kind makes the build refuse, see tests/test_engine_trust.py).
    (output / "rank1.safetensors").write_bytes(b"from an older build")
    build(base.checkpoint, output, dtype="float16", max_batch_size=2)
    doc = json.loads((output / "engine.json").read_text())
    assert (doc["build_config"]["dtype"], doc["build_config"]["max_batch_size"]) == ("float16", 2)
    assert not (output / "rank1.safetensors").exists()
    assert not list(tmp_path.glob(".engine*"))
    assert len(greedy_ids(output, base.prompt_ids)) == 8


def test_failed_rebuild_keeps_the_old_engine(base, tmp_path):
    output = build(base.checkpoint, tmp_path / "engine")
    before = (output / "engine.json").read_bytes()
    checkpoint = shutil.copytree(base.checkpoint, tmp_path / "ckpt")
    _drop_tensor(checkpoint)
    with pytest.raises(BuildError, match="lacks tensors"):
        build(checkpoint, output)
    assert (output / "engine.json").read_bytes() == before
    assert not list(tmp_path.glob(".engine*"))
    assert greedy_ids(output, base.prompt_ids) == base.hf_tokens


def test_output_dot_builds_into_the_current_directory(base, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    build(base.checkpoint, ".")
    # The engine replaced the directory, so this process's cwd is gone; a shell would `cd .` too.
    monkeypatch.chdir(here)
    build(base.checkpoint, ".", dtype="float16")  # and replaces the engine it is in
    assert json.loads((here / "engine.json").read_text())["build_config"]["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]


def test_output_symlink_to_an_engine_rebuilds_its_target(base, tmp_path):
    target = build(base.checkpoint, tmp_path / "engine-v1")
    link = tmp_path / "current"
    link.symlink_to(target, target_is_directory=True)
    build(base.checkpoint, link, dtype="float16")
    assert link.is_symlink()
    assert json.loads((target / "engine.json").read_text())["build_config"]["dtype"] == "float16"

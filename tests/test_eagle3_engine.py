"""An EAGLE-3 head built into a kiln engine (`kiln build --checkpoint HEAD_DIR --speculative-target TARGET`):
random heads in the published layout over the tiny random target of test_eagle3 build into head engines that
draft exactly as their checkpoints do (same greedy output, same acceptance counts, output equal to decoding
without speculation); heads for another model, a missing --speculative-target and a tampered head-engine file
are refused by name; a head engine loaded with another target warns naming both; the bundled
kiln-tiny-code-eagle3 builds against the bundled target."""

from __future__ import annotations

import json
import logging

import pytest
from test_eagle3 import HIDDEN, VOCAB, target, write_head  # noqa: F401  (target: the module's fixture)

from kiln.builder.build import BuildError
from kiln.builder.eagle3_head import build_head_engine
from kiln.cli import main
from kiln.engine_format import EngineError
from kiln.runtime import LLM, SamplingParams

TIGHT = dict(max_batch_size=4, max_num_tokens=32, num_kv_blocks=12)
PROMPTS = [[5, 17, 33, 2, 90, 41], list(range(3, 40)), [7, 7, 7, 8]]


def _spec(head, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _generate(engine, spec: dict | None = None) -> tuple[list[list[int]], dict]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kwargs = {} if spec is None else {"speculative_config": spec}
    with LLM(engine, **kwargs, **TIGHT) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
        return tokens, (llm.speculation_stats() if spec else {})


@pytest.mark.parametrize("embed", [False, True], ids=["target's embedding", "own embedding"])
def test_a_built_head_drafts_as_its_checkpoint_does(target, tmp_path, embed):  # noqa: F811
    head, _ = write_head(tmp_path / "head", embed=embed)
    engine = build_head_engine(head, tmp_path / "head-engine", target[0])
    doc = json.loads((engine / "engine.json").read_text())
    assert doc["architecture"] == "LlamaForCausalLMEagle3" and doc["build_config"]["dtype"] == "float32"
    assert doc["build_config"]["speculative_target"]["engine"] == str(target[0])
    assert set(doc["files"]) == {"rank0.safetensors"}
    plain, _ = _generate(target[0])
    from_checkpoint, checkpoint_stats = _generate(target[0], _spec(head))
    from_engine, engine_stats = _generate(target[0], _spec(engine))
    assert from_engine == from_checkpoint == plain
    assert engine_stats == checkpoint_stats and engine_stats["num_drafts"] > 0


def test_heads_for_another_model_are_refused_naming_both(target, tmp_path):  # noqa: F811
    wide, _ = write_head(tmp_path / "wide", hidden=2 * HIDDEN)
    with pytest.raises(BuildError, match=rf"head {wide} reads features of hidden size {2 * HIDDEN} but the target "
                                         rf"engine {target[0]}'s hidden size is {HIDDEN}"):
        build_head_engine(wide, tmp_path / "out", target[0])
    other, _ = write_head(tmp_path / "other", vocab=VOCAB + 100)
    with pytest.raises(BuildError, match=rf"vocabulary of {VOCAB + 100} tokens but the target engine {target[0]} "
                                         rf"has {VOCAB}"):
        build_head_engine(other, tmp_path / "out", target[0])
    assert not (tmp_path / "out").exists()
    # The target must be a kiln engine, not a checkpoint.
    with pytest.raises(BuildError, match=rf"--speculative-target {tmp_path / 'nowhere'}: .* does not exist"):
        build_head_engine(wide, tmp_path / "out", tmp_path / "nowhere")
    with pytest.raises(BuildError, match=rf"--speculative-target {wide}: {wide} has no engine.json"):
        build_head_engine(wide, tmp_path / "out", wide)


def test_a_head_checkpoint_without_its_target_is_refused(target, tmp_path, capsys):  # noqa: F811
    head, _ = write_head(tmp_path / "head")
    assert main(["build", "--checkpoint", str(head), "--output", str(tmp_path / "out")]) != 0
    assert "name the target's kiln engine with --speculative-target TARGET_ENGINE" in capsys.readouterr().err
    assert main(["build", "--checkpoint", str(head), "--output", str(tmp_path / "out"), "--speculative-target",
                 str(target[0]), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "out" / "engine.json").read_text())["build_config"]["dtype"] == "bfloat16"


def test_a_tampered_head_engine_file_is_refused_by_its_hash(target, tmp_path):  # noqa: F811
    head, _ = write_head(tmp_path / "head")
    engine = build_head_engine(head, tmp_path / "head-engine", target[0])
    weights = engine / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # a weight's byte, the size unchanged
    weights.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="rank0.safetensors has sha256 that differs from the manifest"):
        LLM(target[0], speculative_config=_spec(engine))


def test_a_head_engine_loaded_with_another_target_warns_naming_both(target, tmp_path, caplog):  # noqa: F811
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    head, _ = write_head(tmp_path / "head")
    engine = build_head_engine(head, tmp_path / "head-engine", target[0])
    twin = build_engine(target[0].parent / "ckpt", tmp_path / "twin", BuildConfig(dtype="bfloat16"), progress=False)
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        with LLM(twin, speculative_config=_spec(engine), **TIGHT):
            pass
    assert f"was built for the target engine {target[0]}, not for {twin}" in caplog.text


def test_the_bundled_head_builds_against_the_bundled_target(tiny_code_engine, tmp_path):
    from serve_util import EXAMPLES

    engine = build_head_engine(EXAMPLES / "kiln-tiny-code-eagle3", tmp_path / "head", tiny_code_engine)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = "def fibonacci(n):"
    with LLM(tiny_code_engine) as llm:
        plain = llm.generate([prompt], params)[0].token_ids
    with LLM(tiny_code_engine, speculative_config=_spec(engine, 4)) as llm:
        assert llm.generate([prompt], params)[0].token_ids == plain
        assert llm.speculation_stats()["num_accepted_tokens"] > 0

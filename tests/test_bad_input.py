"""Bad input gets a clear error naming the problem, and the engine keeps serving with its KV cache intact."""

from __future__ import annotations

import json
import shutil

import pytest
from model_factory import make_engine

from kiln.engine_format import ENGINE_FORMAT_VERSION, EngineError
from kiln.runtime import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    _, engine, _ = make_engine(tmp_path_factory.mktemp("bad"), max_batch_size=4, max_num_tokens=64, max_seq_len=64)
    return engine


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir)


@pytest.mark.parametrize("prompt, params, message", [
    ("", GREEDY, "prompt is empty"),
    ([], GREEDY, "prompt is empty"),
    ([5, 400], GREEDY, "prompt token 1 is 400, outside the vocabulary [0, 400)"),
    ([-1], GREEDY, "prompt token 0 is -1"),
    ([3, "x"], GREEDY, "prompt token 1 is 'x'"),
    ([3] * 60, SamplingParams(max_tokens=10), "= 70 exceeds max_seq_len 64"),
])
def test_bad_requests_raise_and_leave_the_cache_alone(llm, prompt, params, message):
    before = llm.kv_cache_stats()
    with pytest.raises(ValueError) as err:
        llm.generate(prompt, params)
    assert message in str(err.value)
    assert llm.kv_cache_stats() == before
    assert llm.generate("the cat", GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"top_k": -1}, "top_k=-1"),
    ({"min_p": 2.0}, "min_p=2.0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ({"presence_penalty": 3.0}, "presence_penalty=3.0"),
    ({"frequency_penalty": -2.5}, "frequency_penalty=-2.5"),
    ({"seed": -1}, "seed=-1"),
    ({"stop": [""]}, "stop="),
    ({"temperature": float("nan")}, "temperature=nan"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kwargs)


def test_one_bad_prompt_in_a_batch_adds_nothing(llm):
    before = llm.kv_cache_stats()
    with pytest.raises(ValueError, match="prompt 2: prompt is empty"):
        llm.generate(["the cat", "a dog", ""], GREEDY)
    assert llm.kv_cache_stats() == before


def test_request_larger_than_the_whole_cache(engine_dir):
    small = LLM(engine_dir, num_kv_blocks=2)
    with pytest.raises(ValueError, match="needs 3 KV blocks but the cache has only 2"):
        small.generate([3] * 30, SamplingParams(max_tokens=10))
    assert small.generate([3] * 20, GREEDY)[0].finish_reason == "length"


def test_runtime_limits_cannot_exceed_the_build(engine_dir):
    with pytest.raises(ValueError, match="max_batch_size=8 exceeds the engine's built limit 4"):
        LLM(engine_dir, max_batch_size=8)
    with pytest.raises(ValueError, match="max_num_tokens=0 must be a positive integer"):
        LLM(engine_dir, max_num_tokens=0)


def _copy(engine_dir, tmp_path):
    target = tmp_path / "engine"
    shutil.copytree(engine_dir, target)
    return target


def test_missing_engine_directory(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        LLM(tmp_path / "nowhere")


def test_malformed_engine_json(engine_dir, tmp_path):
    engine = _copy(engine_dir, tmp_path)
    (engine / "engine.json").write_text("{not json")
    with pytest.raises(EngineError, match="engine.json"):
        LLM(engine)


def test_unreadable_engine_json(engine_dir, tmp_path):
    engine = _copy(engine_dir, tmp_path)
    (engine / "engine.json").unlink()
    (engine / "engine.json").mkdir()
    with pytest.raises(EngineError, match="engine.json"):
        LLM(engine)


def test_truncated_weights(engine_dir, tmp_path):
    engine = _copy(engine_dir, tmp_path)
    weights = engine / "rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(EngineError, match="rank0.safetensors.*truncated or modified"):
        LLM(engine)


def test_modified_weights_fail_checksum_verification(engine_dir, tmp_path):
    engine = _copy(engine_dir, tmp_path)
    weights = engine / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    LLM(engine, verify_checksums=False)  # sizes match: the fast check passes
    with pytest.raises(EngineError, match="sha256"):
        LLM(engine)  # verified by default


def test_newer_format_version(engine_dir, tmp_path):
    engine = _copy(engine_dir, tmp_path)
    doc = json.loads((engine / "engine.json").read_text())
    doc["format_version"] = ENGINE_FORMAT_VERSION + 1
    (engine / "engine.json").write_text(json.dumps(doc))
    with pytest.raises(EngineError, match="upgrade kiln"):
        LLM(engine)


def test_engine_for_another_device(engine_dir, tmp_path):
    engine = _copy(engine_dir, tmp_path)
    doc = json.loads((engine / "engine.json").read_text())
    doc["target"]["device_type"] = "cuda"
    (engine / "engine.json").write_text(json.dumps(doc))
    with pytest.raises(EngineError, match="built for device type 'cuda' but is loaded on 'cpu'"):
        LLM(engine, device="cpu")

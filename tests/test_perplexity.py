"""`kiln eval perplexity` and `kiln.bench.perplexity` agree with transformers on the bundled model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from model_factory import hf_perplexity

from kiln.bench.perplexity import perplexity, split_windows
from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.cli import main
from kiln.runtime import LLM

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODEL = EXAMPLES / "kiln-tiny-code"
HELDOUT = EXAMPLES / "heldout-sample.txt"  # json/decoder.py: its package was held out of training


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(MODEL, tmp_path_factory.mktemp("ppl") / "engine", BuildConfig(dtype="float32"),
                        progress=False)


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def token_ids():
    return transformers.AutoTokenizer.from_pretrained(MODEL).encode(HELDOUT.read_text())


def test_split_windows():
    assert split_windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]  # the lone last token scores nothing
    assert split_windows(list(range(8)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_windows([5], 4) == []
    with pytest.raises(ValueError, match="window_len"):
        split_windows([1, 2, 3], 1)


@pytest.mark.parametrize("max_num_tokens, window_len", [(2048, None), (96, None), (2048, 300)],
                         ids=["whole-windows", "chunked-prefill", "short-windows"])
def test_engine_perplexity_matches_transformers_within_1_percent(engine, hf_model, token_ids, max_num_tokens,
                                                                 window_len):
    llm = LLM(engine, max_num_tokens=max_num_tokens)
    result = perplexity(llm, HELDOUT.read_text(), window_len=window_len)
    expected, scored = hf_perplexity(hf_model, token_ids, result.window_len)
    assert result.num_tokens == len(token_ids) and result.num_scored_tokens == scored
    assert abs(result.perplexity / expected - 1) < 0.01
    assert abs(result.perplexity / expected - 1) < 1e-4  # float32 on both sides: really the same numbers
    # The model learned Python: random weights would give about the vocabulary size (8192).
    assert result.perplexity < 12
    assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]


def test_max_tokens_keeps_the_first_tokens(engine, hf_model, token_ids):
    result = perplexity(LLM(engine), token_ids, max_tokens=500)
    assert (result.num_tokens, result.num_scored_tokens, result.num_windows) == (500, 499, 1)
    assert abs(result.perplexity / hf_perplexity(hf_model, token_ids[:500], 1023)[0] - 1) < 1e-4


def test_cli_prints_perplexity_and_json(engine, capsys):
    assert main(["eval", "perplexity", "--engine", str(engine), "--text-file", str(HELDOUT),
                 "--max-tokens", "400"]) == 0
    assert capsys.readouterr().out.startswith("perplexity ")
    assert main(["eval", "perplexity", "--engine", str(engine), "--text-file", str(HELDOUT),
                 "--max-tokens", "400", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_tokens"] == 400 and result["num_scored_tokens"] == 399 and result["perplexity"] > 1


@pytest.mark.parametrize("content, args, message", [
    (None, [], "no such file"),
    (b"", [], "the file is empty"),
    (b"\xff\xfe bad", [], "not UTF-8"),
    (b"x = 1\n", ["--max-tokens", "1"], "--max-tokens must be at least 2"),
    (b"x = 1\n", ["--window", "5000"], "--window 5000 exceeds"),
])
def test_cli_bad_input_exits_2_naming_the_problem(engine, tmp_path, capsys, content, args, message):
    text_file = tmp_path / "text.txt"
    if content is not None:
        text_file.write_bytes(content)
    argv = ["eval", "perplexity", "--engine", str(engine), "--text-file", str(text_file), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln eval perplexity: error: ") and message in err

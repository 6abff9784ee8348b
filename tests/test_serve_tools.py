"""The tools our users already run against vLLM, run against `kiln serve` on the bundled model.

- lm-eval (in the `test` extra; skipped without it): `local-completions` on two tasks defined here with local
  data (nothing is downloaded): a loglikelihood (multiple choice) task whose scores must equal the runtime's own
  prompt logprobs, and a generate_until task whose answers must equal greedy generation.
- guidellm cannot be a test dependency (in this venv it would downgrade click and multidict, which aiohttp uses;
  a clean install pulls CUDA torch 2.14), so the requests a real guidellm 0.8.1 run sent are replayed here.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from kiln.runtime import LLM, SamplingParams

MODEL = "kiln-tiny-code"
CHOICE_DOCS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
    {"context": "import numpy as", "choices": [" np", " pd", " torch"], "label": 0},
    {"context": "for i in range(10):\n   ", "choices": [" print(i)", " pass", " break"], "label": 0},
]
GEN_DOCS = [{"context": "def add(a, b):\n", "target": "    return a + b"},
            {"context": "import os\nimport", "target": " sys"}]


def _write_tasks(directory) -> None:
    for name, docs in (("choice", CHOICE_DOCS), ("gen", GEN_DOCS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = ("dataset_path: json\ntest_split: test\ndoc_to_text: \"{{context}}\"\n")
    (directory / "kiln_choice.yaml").write_text(
        "task: kiln_tiny_choice\n" + common
        + f"dataset_kwargs:\n  data_files:\n    test: {directory / 'choice.jsonl'}\n"
        + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        + "metric_list:\n  - metric: acc\n")
    (directory / "kiln_gen.yaml").write_text(
        "task: kiln_tiny_gen\n" + common
        + f"dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        + "output_type: generate_until\ndoc_to_target: \"{{target}}\"\n"
        + "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        + "metric_list:\n  - metric: exact_match\n")


def test_lm_eval_local_completions(server, tiny_code_engine, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[test]')")
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")  # nothing may be downloaded
    _write_tasks(tmp_path)
    lm = LocalCompletionsAPI(model=MODEL, base_url=server.http_base + "/v1/completions",
                             tokenizer=str(tiny_code_engine / "tokenizer"), tokenizer_backend="huggingface",
                             num_concurrent=1, max_retries=1, max_length=1024)
    results = simple_evaluate(model=lm, tasks=["kiln_tiny_choice", "kiln_tiny_gen"],
                              task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                              bootstrap_iters=0)
    llm = LLM(tiny_code_engine)

    # loglikelihood: every (context, continuation) scored as the runtime scores those tokens
    samples = results["samples"]["kiln_tiny_choice"]
    assert len(samples) == len(CHOICE_DOCS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            out = llm.generate(ctx_ids + cont_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True,
                                                                 prompt_top_logprobs=1))[0]
            n = len(ctx_ids)
            loglikelihood, is_greedy = resp[0]
            assert loglikelihood == pytest.approx(sum(out.prompt_logprobs[n:]), abs=1e-4)
            greedy = all(next(iter(out.prompt_top_logprobs[i])) == out.prompt_token_ids[i]
                         for i in range(n, len(out.prompt_token_ids)))
            assert is_greedy == greedy
    assert 0.0 <= results["results"]["kiln_tiny_choice"]["acc,none"] <= 1.0

    # generate_until: greedy text, cut at the stop sequence
    samples = results["samples"]["kiln_tiny_gen"]
    assert len(samples) == len(GEN_DOCS)
    for sample in samples:
        context = sample["arguments"][0][0]
        expected = llm.generate(lm.tok_encode(context), SamplingParams(max_tokens=8, temperature=0,
                                                                       stop=["\n\n"]))[0]
        assert sample["resps"][0][0] == expected.text
    assert "exact_match,none" in results["results"]["kiln_tiny_gen"]


def test_guidellm_request_shapes(server):
    """What guidellm 0.8.1's default backend (openai_http) sent to `kiln serve` when run by hand: GET /health
    (it stops there if that fails), GET /v1/models, then per request this body (its default route is chat, so
    the server needs a chat template: the bundled model ships one)."""
    with urllib.request.urlopen(server.http_base + "/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(server.http_base + "/v1/models", timeout=10) as response:
        assert json.loads(response.read())["data"][0]["id"] == MODEL
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 16, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "1 0 m0 Finish medical want"}]}]}
    for path in ("/v1/chat/completions", "/v1/completions"):
        if path == "/v1/completions":  # its text-completions request type
            body = {**{k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens")},
                    "prompt": "1 0 m0 Finish medical want", "max_tokens": 16}
        request = urllib.request.Request(server.http_base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            lines = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 16

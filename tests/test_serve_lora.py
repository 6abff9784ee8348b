"""LoRA adapters through `kiln serve` (vLLM's interface): `--lora-modules name=path`, the OpenAI `model` picks
the adapter, /v1/models lists them with their parent, /v1/load_lora_adapter and /v1/unload_lora_adapter add and
remove them while serving, and per-adapter metrics. Real PEFT adapters on the bundled kiln-tiny-code."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
import transformers
from lora_util import make_adapter
from serve_util import MODEL_NAME, post_json, start_server

from kiln.runtime import LLM, LoRARequest, SamplingParams
from kiln.serve.config import ServeConfig
from kiln.serve.lora_modules import parse_lora_module

pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    return {"a8": make_adapter(base, root / "a8", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])[0],
            "a16": make_adapter(base, root / "a16", 2, r=16, lora_alpha=8,
                                target_modules=["o_proj", "gate_proj", "up_proj"])[0],
            "late": make_adapter(base, root / "late", 3, r=4, lora_alpha=32,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])[0]}


@pytest.fixture(scope="module")
def expected(tiny_code_engine, adapters):
    """Greedy text per (adapter name or None, prompt) from the runtime itself."""
    llm = LLM(tiny_code_engine, enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    texts = {}
    for i, name in enumerate([None, "a8", "a16", "late"]):
        lora = None if name is None else LoRARequest(name, i, str(adapters[name]))
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, lora_request=lora)):
            texts[name, prompt] = out.text
    for name in ("a8", "a16", "late"):  # else the comparison proves nothing
        assert any(texts[name, p] != texts[None, p] for p in PROMPTS), name
    return texts


@pytest.fixture(scope="module")
def lora_server(tiny_code_engine, adapters):
    srv = start_server(tiny_code_engine, enable_lora=True, max_loras=2, max_lora_rank=16,
                       lora_modules=(("a8", str(adapters["a8"])), ("a16", str(adapters["a16"]))))
    yield srv
    srv.stop()


def complete(client, model: str) -> list[str]:
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert out.model == model
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_model_selects_adapter(lora_server, expected):
    client = openai.OpenAI(base_url=lora_server.http_base + "/v1", api_key="none", max_retries=0)
    for name in (None, "a8", "a16"):
        assert complete(client, name or MODEL_NAME) == [expected[name, p] for p in PROMPTS], name
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "a8", "a16"}
    assert models["a8"].parent == MODEL_NAME and models["a16"].parent == MODEL_NAME
    assert models[MODEL_NAME].parent is None
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert all(name in e.value.body["message"] for name in ("nope", MODEL_NAME, "a8", "a16"))
    metrics = urllib.request.urlopen(lora_server.metrics_url, timeout=10).read().decode()
    assert 'kiln_lora_requests_total{lora_name="a8"} 2.0' in metrics
    assert "kiln_lora_adapters_loaded 2.0" in metrics
    loads = [line for line in metrics.splitlines() if line.startswith("kiln_lora_slot_loads_total ")]
    assert loads and float(loads[0].split()[1]) >= 2  # both adapters were put into a device slot


def test_load_use_unload(lora_server, adapters, expected):
    client = openai.OpenAI(base_url=lora_server.http_base + "/v1", api_key="none", max_retries=0)
    assert post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})[0] \
        == 200
    status, body = post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["a8"])})
    assert status == 400 and "already" in body
    status, body = post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nowhere"})
    assert status == 400 and "lora_path" in body
    assert complete(client, "late") == [expected["late", p] for p in PROMPTS]
    assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    status, body = post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 404 and "late" in body
    # loaded again under the same name: a fresh id, the same output
    assert post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})[0] \
        == 200
    assert complete(client, "late") == [expected["late", p] for p in PROMPTS]
    assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200


def test_unload_in_use_is_refused(lora_server):
    loras = lora_server.service.loras
    request = loras.lookup("a8")
    loras.acquire(request)
    try:
        status, body = post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "a8"})
        assert status == 409 and "in use by running requests" in body
    finally:
        loras.release(request)


def test_a_request_holds_its_adapter_from_resolving_it_to_its_end(lora_server, adapters, expected, monkeypatch):
    """A request that resolved its adapter but has not reached the engine yet (held here while its prompt is
    worked on) already counts as using it: unloading is refused (409) until it has ended, and counts go back
    to zero whether it succeeded, failed or its client went away."""
    service = lora_server.service
    assert post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "racy", "lora_path": str(adapters["late"])})[0] \
        == 200
    gate, entered = threading.Event(), threading.Event()
    real = service.prompt_ids

    async def held_prompt_ids(prompt, params):
        entered.set()
        await asyncio.to_thread(gate.wait, 30)
        return await real(prompt, params)

    monkeypatch.setattr(service, "prompt_ids", held_prompt_ids)
    body = {"model": "racy", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    answers: list[tuple[int, str]] = []
    client = threading.Thread(target=lambda: answers.append(post_json(lora_server, "/v1/completions", body)))
    client.start()
    try:
        assert entered.wait(30)
        status, text = post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "racy"})
        assert status == 409 and "racy" in text
    finally:
        gate.set()
        client.join(60)
    assert answers[0][0] == 200 and json.loads(answers[0][1])["choices"][0]["text"] == expected["late", PROMPTS[0]]
    assert service.loras.users("racy") == 0
    # a refused request and a client that went away release it too
    assert post_json(lora_server, "/v1/completions", {**body, "temperature": "hot"})[0] == 400
    gate.clear()
    entered.clear()
    with pytest.raises(OSError):  # the client gives up while its request is held
        post_json(lora_server, "/v1/completions", body, timeout=0.5)
    assert entered.wait(30)
    gate.set()
    deadline = time.monotonic() + 30
    while service.loras.users("racy") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.loras.users("racy") == 0
    assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "racy"})[0] == 200


def test_without_enable_lora(server):
    status, body = post_json(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
    assert status == 404 and "--enable-lora" in body


def test_config_and_flag_errors(tiny_code_engine, tmp_path):
    with pytest.raises(ValueError, match="--enable-lora"):
        ServeConfig(engine_dir="e", lora_modules=(("a", "/a"),))
    assert parse_lora_module("a=/x/y") == ("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == ("a", "/x")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("nopath")
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--lora-modules broken="):
        start_server(tiny_code_engine, enable_lora=True, lora_modules=(("broken", str(tmp_path)),))

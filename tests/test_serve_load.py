"""64 concurrent streaming clients over both HTTP protocols, a quarter of them leaving midway: every finished
stream equals its greedy reference, and afterwards every KV block is free and /metrics agrees."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest
from serve_util import MODEL_NAME

from kiln.runtime import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "def parse(text):",
           "# utilities\n", "try:\n    import numpy as np\n", "if __name__ == '__main__':"]
MAX_TOKENS = 12
LONG = 300  # tokens the leaving clients ask for: they are surely still running when they leave


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def references(tiny_code_engine):
    llm = LLM(tiny_code_engine)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


async def _events(response: aiohttp.ClientResponse):
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


async def client(session: aiohttp.ClientSession, base: str, i: int) -> tuple[str, str | None]:
    """Returns (prompt, streamed text), or (prompt, None) for a client that left midway."""
    prompt = PROMPTS[i % len(PROMPTS)]
    leaves = i % 8 in (1, 2)  # 16 of 64, on both protocols
    max_tokens = LONG if leaves else MAX_TOKENS
    if i % 2 == 0:
        url = f"{base}/v1/completions"
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    else:
        url = f"{base}/v2/models/{MODEL_NAME}/generate_stream"
        body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "exclude_input_in_output": True}
    pieces = []
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for event in _events(response):
            if "choices" in event:
                pieces.append(event["choices"][0]["text"] if event["choices"] else "")
            else:
                assert "error" not in event, event
                pieces.append(event["text_output"])
            if leaves and len(pieces) >= 2:
                response.close()  # the client goes away mid-stream
                return prompt, None
    return prompt, "".join(pieces)


def test_64_streaming_clients_a_quarter_leaving(server, references):
    before = scrape(server.metrics_url)

    async def run_all():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(client(session, server.http_base, i) for i in range(64)))

    results = asyncio.run(run_all())
    finished = [(p, text) for p, text in results if text is not None]
    assert len(finished) == 48
    for prompt, text in finished:
        assert text == references[prompt], prompt

    deadline = time.monotonic() + 10
    while True:
        stats = server.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0

    after = scrape(server.metrics_url)

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    done = delta('kiln_requests_total{outcome="stop"}') + delta('kiln_requests_total{outcome="length"}')
    assert done == 48
    assert delta('kiln_requests_total{outcome="abort"}') == 16
    assert delta('kiln_requests_total{outcome="rejected"}') == 0 and delta('kiln_requests_total{outcome="error"}') == 0
    assert delta("kiln_e2e_request_latency_seconds_count") == 48
    assert delta("kiln_time_to_first_token_seconds_count") == 64
    assert after["kiln_kv_cache_free_blocks"] == after["kiln_kv_cache_blocks"]
    assert after["kiln_num_requests_running"] == 0

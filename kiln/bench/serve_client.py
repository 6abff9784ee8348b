"""`kiln bench serve`: load an OpenAI-compatible server with Poisson arrivals and measure what users feel.

Streams every request (`/v1/completions` or `/v1/chat/completions`, `stream_options.include_usage`), so
time to first token and the gaps between streamed pieces are measured at the client; token counts come
from the server's `usage`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiohttp

# Plain English words: about one token each for common BPE vocabularies.
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there one all we can if more when will would who so what up out about into "
          "than them only other new some could time these two may then do first any my now such like our over "
          "man me even most made after also did many before must through back years where much your way well "
          "down should because each just those people how too little state good very make world still own see "
          "men work long get here between both life being under never day same another know while last might "
          "us great old year off come since against go came right used take three").split()


@dataclass(frozen=True)
class BenchConfig:
    url: str  # server base URL, e.g. http://127.0.0.1:8000
    num_prompts: int
    request_rate: float  # requests per second (Poisson arrivals); math.inf sends all at once
    input_len: int = 128  # words per prompt (about as many tokens)
    output_len: int = 128  # max_tokens of each request
    model: str | None = None  # default: the first model /v1/models lists
    endpoint: str = "completions"  # or "chat"
    ignore_eos: bool = True  # every request generates output_len tokens (vLLM and kiln accept it)
    max_concurrency: int | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"--input-len and --output-len must be >= 1, got {self.input_len}, {self.output_len}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint must be completions or chat, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between streamed pieces
    prompt_tokens: int = 0
    completion_tokens: int = 0


def make_prompts(config: BenchConfig) -> list[str]:
    rng = random.Random(config.seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(config.input_len)) for _ in range(config.num_prompts)]


async def _resolve_model(session: aiohttp.ClientSession, config: BenchConfig) -> str:
    if config.model:
        return config.model
    async with session.get(f"{config.url}/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(f"GET {config.url}/v1/models answered {resp.status}: {(await resp.text())[:200]}")
        models = (await resp.json())["data"]
    if not models:
        raise ValueError(f"{config.url}/v1/models lists no model")
    return models[0]["id"]


async def _one(session: aiohttp.ClientSession, config: BenchConfig, model: str, prompt: str) -> RequestResult:
    body: dict = {"model": model, "max_tokens": config.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(config.url + path, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                piece = ""
                if choices:
                    piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.ttft > 0
        if not result.ok:
            result.error = "the stream carried no text"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_bench(config: BenchConfig) -> dict:
    """Sends the requests and returns the summary (what `kiln bench serve` prints and saves)."""
    prompts = make_prompts(config)
    rng = random.Random(config.seed + 1)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limit = asyncio.Semaphore(config.max_concurrency or config.num_prompts)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        try:
            model = await _resolve_model(session, config)
        except aiohttp.ClientError as e:
            raise ValueError(f"cannot reach {config.url}: {e}") from None

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await _one(session, config, model, prompt)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(config.request_rate):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(config, model, results, duration)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(config: BenchConfig, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0
    ttft = [r.ttft * ms for r in ok]
    itl = [g * ms for r in ok for g in r.gaps]
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) * ms for r in ok if r.completion_tokens > 1]
    e2e = [r.e2e * ms for r in ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def stats(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values) if values else float("nan"), "p50": _pct(values, 50),
                "p99": _pct(values, 99)}

    return {
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens,
        "completion_tokens": out_tokens,
        "ttft_ms": stats(ttft),
        "itl_ms": stats(itl),
        "tpot_ms": stats(tpot),
        "e2e_ms": stats(e2e),
    }


def to_json(value):
    """The summary with non-finite numbers (no samples, an infinite rate) as null: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def format_table(summary: dict) -> str:
    c = summary["config"]
    rows = [
        ("model", summary["model"]),
        ("requests (completed / failed)", f"{summary['completed']} / {summary['failed']}"),
        ("request rate (req/s)", c["request_rate"]),
        ("input / output length", f"{c['input_len']} words / {c['output_len']} tokens"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("output token throughput (tok/s)", f"{summary['output_token_throughput']:.1f}"),
        ("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
    ]
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
                       ("tpot_ms", "time per output token"), ("e2e_ms", "end-to-end latency")):
        s = summary[key]
        rows.append((f"{label} (ms) mean / p50 / p99", f"{s['mean']:.2f} / {s['p50']:.2f} / {s['p99']:.2f}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)

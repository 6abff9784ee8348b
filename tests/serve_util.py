"""A real `kiln serve` server for tests: the bundled kiln-tiny-code (float32, CPU), in a background thread
with its own event loop, on free ports. Clients (tritonclient, openai, raw HTTP) talk to it over sockets."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from kiln.runtime.options import FIELD_NAMES as RUNTIME_FIELDS
from kiln.runtime.options import RuntimeOptions
from kiln.serve.config import ServeConfig
from kiln.serve.server import KilnServer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODEL_NAME = "kiln-tiny-code"
# A minimal chat template, simpler than the one the bundled model ships (tests that need that one pass
# chat_template=None): role-tagged turns, then the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


async def idle_kv_stats(llm) -> dict[str, int]:
    """An AsyncLLM's KV-cache stats once the engine thread has handled the aborts queued so far and every
    block has come back (or after about a second, for the caller's assertion to report)."""
    await llm.call(lambda engine: None)
    for _ in range(100):
        stats = llm.kv_cache_stats()
        if stats["free_blocks"] == stats["total_blocks"] and stats["num_running"] == 0:
            break
        await asyncio.sleep(0.01)
    return stats


def build_tiny_code_engine(directory: Path, checkpoint: Path = EXAMPLES / "kiln-tiny-code") -> Path:
    """kiln-tiny-code (or another bundled checkpoint) built in float32 (exact comparisons on the CPU); greedy
    outputs are deterministic."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    return build_engine(checkpoint, directory, BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=512),
                        progress=False)


class ServerThread:
    """Runs KilnServer(config) on a private event loop in a thread; `stop()` shuts it down gracefully."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server = KilnServer(config)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-test-server", daemon=True)
        self._thread.start()
        self._started.wait(120)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    @property
    def http_url(self) -> str:  # tritonclient.http wants host:port; use http_base for full URLs
        return f"127.0.0.1:{self.server.http_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    @property
    def service(self):
        return self.server.service

    def call(self, coro, timeout: float = 60):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def kv_cache_stats(self) -> dict[str, int]:
        return self.server.service.llm.kv_cache_stats()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call(self.server.stop(), timeout=120)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)


def start_server(engine: Path, **overrides) -> ServerThread:
    """A server over `engine`; `overrides` are ServeConfig fields or RuntimeOptions fields (max_batch_size=1)."""
    runtime = {name: overrides.pop(name) for name in list(overrides) if name in RUNTIME_FIELDS}
    config = ServeConfig(engine_dir=str(engine), model_name=MODEL_NAME, http_port=0, grpc_port=0, metrics_port=0,
                         chat_template=CHAT_TEMPLATE, shutdown_timeout_s=5.0, runtime=RuntimeOptions(**runtime))
    return ServerThread(replace(config, **overrides))


def message(response: dict) -> str:
    """The error message of an OpenAI (`{"error": {"message"}}`) or Triton (`{"error": "..."}`) error body."""
    error = response["error"]
    return error["message"] if isinstance(error, dict) else error


def counters(server) -> dict[str, float]:
    """The request outcomes and prompt-token counter from /metrics."""
    values = {}
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(("kiln_requests_total", "kiln_prompt_tokens_total")):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def triton_inputs(module, prompt: str, guide_type: str | None, guide: str | None, max_tokens: int = 40, **scalars):
    """Triton inputs for tritonclient's `module` (http or grpc): the prompt, max_tokens, a guide when given, and
    `scalars` as name=(value, datatype)."""
    values = {"text_input": ([[prompt.encode()]], "BYTES"), "max_tokens": ([[max_tokens]], "INT32"),
              "exclude_input_in_output": ([[True]], "BOOL"), **{k: ([[v]], t) for k, (v, t) in scalars.items()}}
    if guide_type is not None:
        values["guided_decoding_guide_type"] = ([[guide_type.encode()]], "BYTES")
    if guide is not None:
        values["guided_decoding_guide"] = ([[guide.encode()]], "BYTES")
    import numpy as np

    from kiln.serve.tritonserver.schema import DATATYPES

    tensors = []
    for name, (value, datatype) in values.items():
        array = np.array(value, dtype=DATATYPES[datatype][1])
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def post_json(server, path: str, body: dict, timeout: float = 60) -> tuple[int, str]:
    """POSTs `body` as JSON to the server's HTTP port; (status, body text), an error status included."""
    request = urllib.request.Request(server.http_base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream_results(responses, timeout: float = 60) -> list:
    """The results of one gRPC stream request (tritonclient's callback puts (result, error) pairs on the queue
    `responses`) up to Triton's final response; fails on an error."""
    results = []
    while True:
        result, error = responses.get(timeout=timeout)
        assert error is None, error
        results.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            return results


def infer_inputs(module, arrays: dict) -> list:
    """tritonclient InferInputs (`module`: tritonclient.http or .grpc) for {input name: numpy array}, each with the
    datatype kiln's schema gives that input."""
    from kiln.serve.tritonserver.schema import INPUT_SPECS

    tensors = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), INPUT_SPECS[name].datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors

"""The door matrix (kiln issue 31): every capability through every door gives the tokens of `LLM` alone.

A capability that works in the runtime must not break at a server: each cell sends a row's requests through
one door and compares what comes back with `LLM.generate` of the same engine and SamplingParams (the
reference: every case of the row in one batch, no speculation). Where a door returns token ids (LLM,
AsyncLLM) they must be equal; where it returns text only, the text must be equal and so must the token count
(OpenAI's `usage.completion_tokens`; Triton's tensors have no count, so the Triton doors always ask
`return_log_probs` and count `output_log_probs`), and the finish reason where the door has one. The chat doors
are compared with `LLM` given the chat-templated prompt (tests/serve_util.py CHAT_TEMPLATE).

Rows (capabilities; engine: the bundled kiln-tiny-code in float32 unless named):
  greedy, seeded (temperature 0.8 + seed), n2 (two seeded choices: seed, seed + 1), stop (a stop string that
  fires mid-output), logprobs (with 2 top logprobs), guided (a JSON schema), ngram (n-gram speculation, K=3:
  greedy to max_tokens 64, two stop strings, seeded sampling), draft (draft-model speculation with
  kiln-tiny-code-draft, K=4: greedy to 64, two stop strings), tp2 (tensor parallel over two gloo processes),
  int8_wo (an int8 weight-only engine), moe (a tiny random Qwen2-MoE checkpoint).
Columns (doors):
  llm (each case alone: batch invariance; with speculation on the speculating LLM), async_cumulative,
  async_delta (the deltas concatenated; both on the server's own AsyncLLM), completions, completions_stream,
  chat, chat_stream (the `openai` client), kserve_infer (tritonclient.http), kserve_generate,
  kserve_generate_stream (/v2/models/<m>/generate[_stream]), grpc, grpc_stream (tritonclient.grpc ModelInfer /
  ModelStreamInfer), triton_repo, triton_repo_stream (the model.py of `kiln triton-repo`, its `execute` driven
  through the stand-in pb_utils of tests/triton_stub).
A cell a door cannot express is collected and skipped with its reason (`pytest -rs`): n > 1 outside the OpenAI
API. The Triton repository model speculates as config.pbtxt's speculative_config says (`kiln triton-repo
--speculative-*`).

Cost: each engine, server and Triton model is made on first use and closed when a row that needs another one
starts (`Matrix`), so a whole row shares one server; rows run in the order listed.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format, text_format
from serve_util import CHAT_TEMPLATE, EXAMPLES, MODEL_NAME, start_server
from tritonclient.grpc import model_config_pb2 as mc

from kiln.runtime import LLM, GuidedDecoding, RequestOutput, SamplingParams
from kiln.runtime.speculative import SpeculativeConfig
from kiln.serve.tritonserver.repository import write_repository
from kiln.serve.tritonserver.schema import DATATYPES, INPUT_SPECS

sys.path.insert(0, str(Path(__file__).parent / "triton_stub"))
import triton_python_backend_utils as pb  # noqa: E402

# ---- the rows ------------------------------------------------------------------------------------------------
FIB = "def fibonacci(n):"
STACK = "class Stack:\n    def push(self, item):"
ADD = "def add(a, b):"
IMPORT = "import os\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "args": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "args"]}
STOP = "fibonacci("  # greedy FIB reaches it after ~12 tokens as a completion, ~22 as a chat answer


@dataclass(frozen=True)
class Case:
    """One prompt of a row: the runtime's params (the reference's) and OpenAI's n (choice j: seed + j)."""

    prompt: str
    params: SamplingParams
    n: int = 1


@dataclass(frozen=True)
class Row:
    """A capability: its cases, on which engine, with which speculation."""

    name: str
    cases: tuple[Case, ...]
    engine: str = "base"  # a key of Engines.make
    speculation: str | None = None  # "ngram" | "draft_model"


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed)


ROWS = (
    Row("greedy", (Case(STACK, greedy(48)),)),
    Row("seeded", (Case(IMPORT, seeded(48, 1234)),)),
    Row("n2", (Case(ADD, seeded(32, 7), n=2),)),
    Row("stop", (Case(FIB, greedy(48, stop=(STOP,))),)),
    Row("logprobs", (Case(ADD, greedy(32, logprobs=True, top_logprobs=2)),)),
    Row("guided", (Case(FIB, greedy(48, guided_decoding=GuidedDecoding(json=SCHEMA))),)),
    # Speculation: prompts, stop strings and seed chosen so that the last step mostly accepts several tokens
    # (as completion / chat: ngram ADD 3 / 2, its stop case 4 / 1, its seeded case 2 / 4; draft ADD 4 / 5, its
    # stop case 3 / 5), the step of which an engine that handed out one update per token lost all but the first.
    Row("ngram", (Case(ADD, greedy(64)), Case(FIB, greedy(64, stop=("Returns", "fibonacci(1)\n1"))),
                  Case(IMPORT, seeded(48, 5))), speculation="ngram"),
    Row("draft", (Case(ADD, greedy(64)), Case(ADD, greedy(64, stop=("of lists\n\n", "</assistant>\n\n")))),
        speculation="draft_model"),
    Row("tp2", (Case(ADD, greedy(32)),), engine="tp2"),
    Row("int8_wo", (Case(STACK, greedy(48)),), engine="int8_wo"),
    Row("moe", (Case(FIB, greedy(32)),), engine="moe"),
)
DOORS = ("llm", "async_cumulative", "async_delta", "completions", "completions_stream", "chat", "chat_stream",
         "kserve_infer", "kserve_generate", "kserve_generate_stream", "grpc", "grpc_stream", "triton_repo",
         "triton_repo_stream")
# Engines whose rank 0 runs in this process (TP > 1): each initializes torch.distributed's default process group,
# so only one of them may be live at a time (a second fails: "trying to initialize the default process group twice").
TP_ENGINES = ("tp2",)
OPENAI_DOORS = ("completions", "completions_stream", "chat", "chat_stream")
TRITON_DOORS = ("kserve_infer", "kserve_generate", "kserve_generate_stream", "grpc", "grpc_stream", "triton_repo",
                "triton_repo_stream")


def unsupported(row: Row, door: str) -> str | None:
    """Why `door` cannot express `row`, or None."""
    if any(case.n > 1 for case in row.cases):
        if door in TRITON_DOORS:
            return "n > 1: TensorRT-LLM's tensors have no n (a client sends batch rows instead)"
        if door not in OPENAI_DOORS:
            return "n > 1: SamplingParams has no n (the OpenAI server expands n into requests seeded seed + j)"
    return None


def _cells():
    for row in ROWS:
        for door in DOORS:
            why = unsupported(row, door)
            marks = [pytest.mark.skip(reason=f"{door} cannot express {row.name}: {why}")] if why else []
            yield pytest.param(row, door, id=f"{row.name}-{door}", marks=marks)


# ---- what a door answers, and the comparison ------------------------------------------------------------------
@dataclass
class Got:
    """One choice as a door returned it; None where the door does not tell."""

    text: str
    token_ids: list[int] | None = None
    num_tokens: int | None = None
    finish_reason: str | None = None
    logprobs: list[float] | None = None


@dataclass
class Answer:
    """A door's answer to one case: its choices and the completion tokens it reports for all of them."""

    choices: list[Got]
    completion_tokens: int | None = None


def compare(answer: Answer, expected: list[RequestOutput], params: SamplingParams, where: str) -> list[str]:
    """-> what differs (empty: the door agrees with LLM)."""
    problems = []
    if len(answer.choices) != len(expected):
        return [f"{where}: {len(answer.choices)} choices, expected {len(expected)}"]
    for j, (got, ref) in enumerate(zip(answer.choices, expected)):
        at = f"{where} choice {j}"
        if got.token_ids is not None and got.token_ids != ref.token_ids:
            first = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b),
                         min(len(got.token_ids), len(ref.token_ids)))
            problems.append(f"{at}: {len(got.token_ids)} token ids, expected {len(ref.token_ids)}; first "
                            f"difference at {first}: {got.token_ids[first:first + 4]} vs {ref.token_ids[first:first + 4]}")
        if got.num_tokens is not None and got.num_tokens != len(ref.token_ids):
            problems.append(f"{at}: {got.num_tokens} tokens, expected {len(ref.token_ids)}")
        if got.text != ref.text:
            first = next((i for i, (a, b) in enumerate(zip(got.text, ref.text)) if a != b),
                         min(len(got.text), len(ref.text)))
            problems.append(f"{at}: text differs from character {first} (got {len(got.text)} chars, expected "
                            f"{len(ref.text)}): got ...{got.text[max(0, first - 10):first + 30]!r}, expected "
                            f"...{ref.text[max(0, first - 10):first + 30]!r}")
        if got.finish_reason is not None and got.finish_reason != ref.finish_reason:
            problems.append(f"{at}: finish_reason {got.finish_reason!r}, expected {ref.finish_reason!r}")
        if params.logprobs:
            if got.logprobs is None:
                problems.append(f"{at}: no logprobs")
            elif len(got.logprobs) != len(ref.logprobs) or not np.allclose(got.logprobs, ref.logprobs, atol=1e-4):
                problems.append(f"{at}: logprobs {np.round(got.logprobs, 4).tolist()} != "
                                f"{np.round(ref.logprobs, 4).tolist()}")
    if answer.completion_tokens is not None and answer.completion_tokens != sum(len(r.token_ids) for r in expected):
        problems.append(f"{where}: completion_tokens {answer.completion_tokens}, expected "
                        f"{sum(len(r.token_ids) for r in expected)}")
    return problems


# ---- engines, servers and models, shared per row ---------------------------------------------------------------
class Engines:
    """Engine directories, built on first use."""

    def __init__(self, base: Path, draft: Path, tmp: Path) -> None:
        self.dirs = {"base": base, "draft": draft}
        self.tmp = tmp

    def __getitem__(self, key: str) -> Path:
        if key not in self.dirs:
            self.dirs[key] = self.make(key)
        return self.dirs[key]

    def make(self, key: str) -> Path:
        from kiln.builder.build import build_engine
        from kiln.builder.build_config import BuildConfig

        limits = dict(dtype="float32", max_batch_size=16, max_num_tokens=512)
        if key == "tp2":
            return build_engine(EXAMPLES / "kiln-tiny-code", self.tmp / key, BuildConfig(**limits, tp_size=2),
                                progress=False)
        if key == "int8_wo":  # weight-only: no calibration, builds in seconds
            return build_engine(EXAMPLES / "kiln-tiny-code", self.tmp / key, BuildConfig(**limits, qformat="int8_wo"),
                                progress=False)
        if key == "moe":
            from model_factory import make_checkpoint

            checkpoint, _ = make_checkpoint(self.tmp / "moe-ckpt", "Qwen2MoeForCausalLM", num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=48)
            return build_engine(checkpoint, self.tmp / key, BuildConfig(**limits), progress=False)
        raise KeyError(key)


class Matrix:
    """Holds at most one of each kind of thing (reference LLM, speculating LLM, server, Triton model); `enter`
    closes those a row does not need, so a TP row's processes do not outlive it."""

    def __init__(self, engines: Engines, tmp: Path) -> None:
        self.engines = engines
        self.tmp = tmp
        self._live: dict[str, tuple[Any, Any, Callable]] = {}  # kind -> (key, object, close)
        self._references: dict[str, dict[str, list[list[RequestOutput]]]] = {}

    def _get(self, kind: str, key, make: Callable, close: Callable, engine: str):
        held = self._live.get(kind)
        if held is not None and held[0] == key:
            return held[1]
        self._close(kind)
        if engine in TP_ENGINES:  # rank 0 takes this process's default process group: one TP engine at a time
            self.close()
        obj = make()
        self._live[kind] = (key, obj, close)
        return obj

    def _close(self, kind: str) -> None:
        held = self._live.pop(kind, None)
        if held is not None:
            held[2](held[1])

    def enter(self, row: Row) -> None:
        wanted = {"reference": row.engine, "spec_llm": (row.engine, row.speculation),
                  "server": (row.engine, row.speculation), "triton": (row.engine, row.speculation)}
        for kind in list(self._live):
            if self._live[kind][0] != wanted[kind]:
                self._close(kind)

    def close(self) -> None:
        for kind in list(self._live):
            self._close(kind)

    def speculative_config(self, row: Row) -> SpeculativeConfig | None:
        if row.speculation == "ngram":
            return SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=3)
        if row.speculation == "draft_model":
            return SpeculativeConfig("draft_model", 4, model=str(self.engines["draft"]))
        return None

    def reference_llm(self, row: Row) -> LLM:
        return self._get("reference", row.engine, lambda: LLM(self.engines[row.engine]), LLM.shutdown, row.engine)

    def llm(self, row: Row) -> LLM:
        """The LLM of the llm door: the reference one, or one that speculates as the row says."""
        if row.speculation is None:
            return self.reference_llm(row)
        return self._get("spec_llm", (row.engine, row.speculation),
                         lambda: LLM(self.engines[row.engine], speculative_config=self.speculative_config(row)),
                         LLM.shutdown, row.engine)

    def server(self, row: Row):
        return self._get("server", (row.engine, row.speculation),
                         lambda: start_server(self.engines[row.engine], speculative_config=self.speculative_config(row)),
                         lambda s: s.stop(), row.engine)

    def triton_model(self, row: Row):
        return self._get("triton", (row.engine, row.speculation),
                         lambda: load_triton_model(self.engines[row.engine], self.tmp / f"triton-{row.engine}",
                                                   self.speculative_config(row)),
                         close_triton_model, row.engine)

    def prompt(self, row: Row, text: str, form: str) -> str:
        """The prompt text LLM gets for a door of this form: as is, or the chat-templated user message."""
        if form == "completion":
            return text
        return self.reference_llm(row).tokenizer.apply_chat_template(
            chat_messages(text), chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)

    def reference(self, row: Row, form: str) -> list[list[RequestOutput]]:
        """LLM's outputs for each case (each choice: seed + j) of the row, completion and chat forms, in one
        batch; computed once per row."""
        if row.name not in self._references:
            llm = self.reference_llm(row)
            prompts, params = [], []
            for f in ("completion", "chat"):
                for case in row.cases:
                    for j in range(case.n):
                        prompts.append(self.prompt(row, case.prompt, f))
                        params.append(choice_params(case, j))
            outputs = iter(llm.generate(prompts, params))
            self._references[row.name] = {f: [[next(outputs) for _ in range(case.n)] for case in row.cases]
                                          for f in ("completion", "chat")}
        return self._references[row.name][form]


def choice_params(case: Case, j: int) -> SamplingParams:
    """Choice j of an OpenAI request with n choices samples with seed + j (serve/openai/request.py)."""
    return case.params if j == 0 else dataclasses.replace(case.params, seed=case.params.seed + j)


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def load_triton_model(engine: Path, repo: Path, speculative_config: SpeculativeConfig | None = None):
    """The repository's model.py imported and initialized as Triton's Python backend does (on the CPU)."""
    import importlib.util

    model_dir = write_repository(engine, repo, model_name="m", force=True,
                                 speculative_config=speculative_config).model_dir
    spec = importlib.util.spec_from_file_location(f"kiln_triton_model_{time.monotonic_ns()}",
                                                  model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    config.parameters["allow_numpy2"].string_value = "true"  # the stand-in takes numpy 2
    model = module.TritonPythonModel()
    model.initialize({"model_config": json_format.MessageToJson(config, preserving_proto_field_name=True),
                      "model_instance_kind": "CPU", "model_instance_name": "m_0_0", "model_instance_device_id": "0",
                      "model_repository": str(model_dir), "model_version": "1", "model_name": "m"})
    return model


def close_triton_model(model) -> None:
    model.finalize()
    model.llm.shutdown()  # finalize already stopped it; a second shutdown is harmless


@pytest.fixture(scope="module")
def matrix(tiny_code_engine, tiny_code_draft_engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("door-matrix")
    m = Matrix(Engines(tiny_code_engine, tiny_code_draft_engine, tmp), tmp)
    yield m
    m.close()


# ---- the doors ------------------------------------------------------------------------------------------------
def _llm(m: Matrix, row: Row, case: Case) -> Answer:
    out = m.llm(row).generate(case.prompt, case.params)[0]
    return Answer([Got(out.text, out.token_ids, finish_reason=out.finish_reason, logprobs=out.logprobs)])


def _async(kind: str):
    def door(m: Matrix, row: Row, case: Case) -> Answer:
        server = m.server(row)
        params = dataclasses.replace(case.params, output_kind=kind)

        async def collect():
            return [out async for out in server.service.llm.generate(case.prompt, params)]

        updates = server.call(collect(), timeout=120)
        assert updates and updates[-1].finished and not any(u.finished for u in updates[:-1])
        if kind == "cumulative":
            out = updates[-1]
            return Answer([Got(out.text, out.token_ids, finish_reason=out.finish_reason, logprobs=out.logprobs)])
        logprobs = [lp for u in updates for lp in u.logprobs] if case.params.logprobs else None
        return Answer([Got("".join(u.text for u in updates), [t for u in updates for t in u.token_ids],
                           finish_reason=updates[-1].finish_reason, logprobs=logprobs)])
    return door


def openai_kwargs(case: Case, chat: bool) -> dict:
    """The OpenAI request for a case (every SamplingParams field the rows use)."""
    p = case.params
    kwargs: dict = {"model": MODEL_NAME, "max_tokens": p.max_tokens, "temperature": p.temperature}
    if case.n > 1:
        kwargs["n"] = case.n
    if p.seed is not None:
        kwargs["seed"] = p.seed
    if p.stop:
        kwargs["stop"] = list(p.stop)
    if p.logprobs:
        kwargs.update({"logprobs": True, "top_logprobs": p.top_logprobs} if chat else {"logprobs": p.top_logprobs})
    if p.guided_decoding is not None:
        response_format = {"type": "json_schema", "json_schema": {"name": "row", "schema": p.guided_decoding.json}}
        if chat:
            kwargs["response_format"] = response_format
        else:  # a kiln (and vLLM) extension of /v1/completions that the openai client does not know
            kwargs["extra_body"] = {"response_format": response_format}
    if chat:
        kwargs["messages"] = chat_messages(case.prompt)
    else:
        kwargs["prompt"] = case.prompt
    return kwargs


def _client(m: Matrix, row: Row) -> openai.OpenAI:
    return openai.OpenAI(base_url=m.server(row).http_base + "/v1", api_key="none", max_retries=0, timeout=120)


def _openai(chat: bool, stream: bool):
    def door(m: Matrix, row: Row, case: Case) -> Answer:
        client = _client(m, row)
        create = client.chat.completions.create if chat else client.completions.create
        kwargs = openai_kwargs(case, chat)
        choices = [Got("") for _ in range(case.n)]
        if not stream:
            response = create(**kwargs)
            for c in response.choices:
                choices[c.index] = Got(c.message.content if chat else c.text, finish_reason=c.finish_reason,
                                       logprobs=_openai_logprobs(c.logprobs, chat))
            return Answer(choices, response.usage.completion_tokens)
        usage = None
        for chunk in create(**kwargs, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                got = choices[c.index]
                got.text += (c.delta.content or "") if chat else c.text
                got.finish_reason = c.finish_reason or got.finish_reason
                piece = _openai_logprobs(c.logprobs, chat)
                if piece is not None:
                    got.logprobs = (got.logprobs or []) + piece
        assert usage is not None, "no usage chunk"
        return Answer(choices, usage)
    return door


def _openai_logprobs(logprobs, chat: bool) -> list[float] | None:
    if logprobs is None:
        return None
    if chat:
        return [t.logprob for t in logprobs.content or []]
    return list(logprobs.token_logprobs or [])


def triton_inputs(case: Case, stream: bool) -> dict[str, np.ndarray]:
    """The case as Triton tensors ([1, ...] each); return_log_probs always (the token count)."""
    p = case.params
    arrays: dict[str, Any] = {"text_input": [case.prompt.encode()], "max_tokens": [p.max_tokens],
                              "temperature": [p.temperature], "return_log_probs": [True],
                              "exclude_input_in_output": [True], "stream": [stream]}
    if p.seed is not None:
        arrays["seed"] = [p.seed]
    if p.stop:
        arrays["stop_words"] = [s.encode() for s in p.stop]
    if p.guided_decoding is not None:
        arrays["guided_decoding_guide_type"] = [b"json_schema"]
        arrays["guided_decoding_guide"] = [json.dumps(p.guided_decoding.json).encode()]
    return {name: np.array([values], dtype=DATATYPES[INPUT_SPECS[name].datatype][1]) for name, values in arrays.items()}


def triton_answer(text: str, logprobs: list[float]) -> Answer:
    return Answer([Got(text, num_tokens=len(logprobs), logprobs=logprobs)])


def _kserve_infer(m: Matrix, row: Row, case: Case) -> Answer:
    client = httpclient.InferenceServerClient(url=m.server(row).http_url, network_timeout=120)
    try:
        tensors = []
        for name, array in triton_inputs(case, stream=False).items():
            tensor = httpclient.InferInput(name, list(array.shape), INPUT_SPECS[name].datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        outputs = [httpclient.InferRequestedOutput(n) for n in ("text_output", "output_log_probs")]
        result = client.infer(MODEL_NAME, tensors, outputs=outputs)
    finally:
        client.close()
    return triton_answer(result.as_numpy("text_output")[0, 0].decode(),
                         result.as_numpy("output_log_probs")[0, 0].tolist())


def _generate_body(case: Case) -> dict:
    body = {}
    for name, array in triton_inputs(case, stream=False).items():
        values = [v.decode() if isinstance(v, bytes) else v.item() for v in array[0]]
        body[name] = values if INPUT_SPECS[name].dims == (-1,) else values[0]
    del body["stream"]
    return body


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def _kserve_generate(m: Matrix, row: Row, case: Case) -> Answer:
    body = json.loads(_post(f"{m.server(row).http_base}/v2/models/{MODEL_NAME}/generate", _generate_body(case)))
    return triton_answer(body["text_output"], body["output_log_probs"])


def _kserve_generate_stream(m: Matrix, row: Row, case: Case) -> Answer:
    raw = _post(f"{m.server(row).http_base}/v2/models/{MODEL_NAME}/generate_stream", _generate_body(case)).decode()
    events = [json.loads(chunk[len("data: "):]) for chunk in raw.split("\n\n") if chunk]
    assert all("error" not in e for e in events), events
    return triton_answer("".join(e["text_output"] for e in events),
                         [lp for e in events for lp in e.get("output_log_probs", [])])


def _grpc_inputs(case: Case, stream: bool) -> list:
    tensors = []
    for name, array in triton_inputs(case, stream).items():
        tensor = grpcclient.InferInput(name, list(array.shape), INPUT_SPECS[name].datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _grpc(stream: bool):
    def door(m: Matrix, row: Row, case: Case) -> Answer:
        client = grpcclient.InferenceServerClient(m.server(row).grpc_url)
        try:
            if not stream:
                result = client.infer(MODEL_NAME, _grpc_inputs(case, False), client_timeout=120)
                return triton_answer(result.as_numpy("text_output")[0, 0].decode(),
                                     result.as_numpy("output_log_probs")[0, 0].tolist())
            results: queue.Queue = queue.Queue()
            client.start_stream(lambda result, error: results.put((result, error)))
            try:
                client.async_stream_infer(MODEL_NAME, _grpc_inputs(case, True), request_id="cell",
                                          enable_empty_final_response=True)
                text, logprobs = "", []
                while True:
                    result, error = results.get(timeout=120)
                    assert error is None, error
                    if result.as_numpy("text_output") is not None:
                        text += result.as_numpy("text_output")[0, 0].decode()
                    if result.as_numpy("output_log_probs") is not None:
                        logprobs += result.as_numpy("output_log_probs")[0, 0].tolist()
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        return triton_answer(text, logprobs)
            finally:
                client.stop_stream()
        finally:
            client.close()
    return door


def _triton_repo(stream: bool):
    def door(m: Matrix, row: Row, case: Case) -> Answer:
        model = m.triton_model(row)
        tensors = [pb.Tensor(name, array) for name, array in triton_inputs(case, stream).items()]
        request = pb.InferenceRequest(tensors, ["text_output", "output_log_probs", "cum_log_probs"])
        assert model.execute([request]) is None
        request.release()  # Triton frees the inputs once execute returns
        assert request.sender.wait_final(120), "no final response"
        text, logprobs = "", []
        for response in request.sender.responses:
            assert not response.has_error(), response.error().message()
            outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
            text += outputs["text_output"][0, 0].decode()
            logprobs += outputs["output_log_probs"][0, 0].tolist()
        return triton_answer(text, logprobs)
    return door


DOOR_CALLS: dict[str, Callable[[Matrix, Row, Case], Answer]] = {
    "llm": _llm, "async_cumulative": _async("cumulative"), "async_delta": _async("delta"),
    "completions": _openai(False, False), "completions_stream": _openai(False, True),
    "chat": _openai(True, False), "chat_stream": _openai(True, True),
    "kserve_infer": _kserve_infer, "kserve_generate": _kserve_generate,
    "kserve_generate_stream": _kserve_generate_stream, "grpc": _grpc(False), "grpc_stream": _grpc(True),
    "triton_repo": _triton_repo(False), "triton_repo_stream": _triton_repo(True),
}
assert tuple(DOOR_CALLS) == DOORS


# ---- the tests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("row", "door"), list(_cells()))
def test_cell(matrix, row: Row, door: str):
    matrix.enter(row)
    form = "chat" if door.startswith("chat") else "completion"
    expected = matrix.reference(row, form)
    problems = []
    for i, case in enumerate(row.cases):
        answer = DOOR_CALLS[door](matrix, row, case)
        problems += compare(answer, expected[i], case.params, f"case {i} ({case.prompt!r}, {form})")
    assert not problems, "\n".join(problems)
    if row.speculation:  # the cell did speculate
        llm = (matrix.llm(row) if door == "llm" else matrix.triton_model(row).llm if door.startswith("triton_repo")
               else matrix.server(row).service.llm)
        stats = llm.speculation_stats()
        assert stats["num_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_each_row_shows_its_capability(matrix, row: Row):
    """The reference itself: long enough to show truncation, stop strings fire mid-output (in both forms),
    n choices differ (that speculation is accepted, test_cell checks). A row that stopped doing this would pass
    every cell vacuously."""
    matrix.enter(row)
    for form in ("completion", "chat"):
        for case, outs in zip(row.cases, matrix.reference(row, form)):
            for out in outs:
                where = f"{form} {case.prompt!r}: {out.finish_reason} after {len(out.token_ids)} tokens {out.text!r}"
                if case.params.stop:
                    assert out.finish_reason == "stop" and 4 <= len(out.token_ids) < case.params.max_tokens, where
                elif case.params.guided_decoding is None:
                    assert len(out.token_ids) >= 24, where
            if case.n > 1:
                assert len({tuple(o.token_ids) for o in outs}) == case.n

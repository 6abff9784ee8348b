"""Triton / KServe v2 over HTTP: health, metadata, config, infer, generate and generate_stream.

One model (`service.model_name`, version "1"). `infer` speaks Triton's binary tensor data extension both
ways, as `tritonclient.http` does by default (the tensors themselves: `kserve_tensors`). Every row of an
`infer` batch is its own engine request; all rows run at once.
"""

from __future__ import annotations

import contextlib
import json
import logging

import numpy as np
from aiohttp import web

import kiln
from kiln.serve.client_json import long_integer_error
from kiln.serve.errors import InvalidRequest, NotFound, RequestError
from kiln.serve.guided_request import TRITON_GUIDE_LABEL
from kiln.serve.http.body import check_json_containers
from kiln.serve.http.common import CONFIG, SERVICE, read_json, read_request_body
from kiln.serve.kserve.tensors import (
    BINARY_HEADER,
    flag,
    from_json,
    infer_response_body,
    input_arrays,
    json_object,
    requested_outputs,
)
from kiln.serve.limits import RequestLimits
from kiln.serve.tritonserver.batch import complete, complete_all, with_loras
from kiln.serve.tritonserver.beam_rows import beams_of, check_beam_widths
from kiln.serve.tritonserver.logits_outputs import generate_fields, streamed
from kiln.serve.tritonserver.request import (
    Beam,
    TritonRequest,
    check_prompt_sizes,
    check_requested_outputs,
    make_outputs,
    pad_ids,
    parse_request,
)
from kiln.serve.tritonserver.schema import (
    INPUT_SPECS,
    MODEL_VERSION,
    model_config,
    model_config_json,
    model_metadata,
)

logger = logging.getLogger("kiln.serve")

EXTENSIONS = ("binary_tensor_data", "model_configuration", "generate", "parameters")


def add_routes(app: web.Application) -> None:
    router = app.router
    router.add_get("/v2/health/live", _live)
    router.add_get("/v2/health/ready", _ready)
    router.add_get("/v2", _server_metadata)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        router.add_get(prefix, _model_metadata)
        router.add_get(prefix + "/ready", _model_ready)
        router.add_get(prefix + "/config", _model_config)
        router.add_post(prefix + "/infer", _infer)
        router.add_post(prefix + "/generate", _generate)
        router.add_post(prefix + "/generate_stream", _generate_stream)


# ---- health and metadata ---------------------------------------------------------------------------
async def _live(_: web.Request) -> web.Response:
    return web.json_response({})


async def _ready(request: web.Request) -> web.Response:
    return web.json_response({}, status=200 if request.app[SERVICE].ready else 503)


async def _server_metadata(_: web.Request) -> web.Response:
    return web.json_response({"name": "kiln", "version": kiln.__version__, "extensions": list(EXTENSIONS)})


def _model_name(request: web.Request) -> str:
    """The served model's name; NotFound for any other name or a version other than MODEL_VERSION."""
    name, served = request.match_info["model"], request.app[SERVICE].model_name
    if name != served:
        raise NotFound(f"unknown model '{name}'; this server serves '{served}'")
    version = request.match_info.get("version", MODEL_VERSION)
    if version != MODEL_VERSION:
        raise NotFound(f"model '{name}' has no version '{version}'; its only version is {MODEL_VERSION}")
    return name


async def _model_metadata(request: web.Request) -> web.Response:
    return web.json_response(model_metadata(_model_name(request)))


async def _model_ready(request: web.Request) -> web.Response:
    _model_name(request)
    return web.json_response({}, status=200 if request.app[SERVICE].ready else 503)


async def _model_config(request: web.Request) -> web.Response:
    config = model_config(_model_name(request), request.app[SERVICE].max_batch_size)
    return web.json_response(model_config_json(config))


# ---- infer -----------------------------------------------------------------------------------------
async def _infer(request: web.Request) -> web.Response:
    name = _model_name(request)
    header, binary = await _read_infer_body(request)
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest(f"'id' must be a string, got {json.dumps(request_id)}", "id")
    parameters = json_object(header.get("parameters"), "parameters")
    service = request.app[SERVICE]
    limits = RequestLimits.from_config(request.app[CONFIG])
    requests = parse_request(input_arrays(header.get("inputs"), binary), limits)
    check_prompt_sizes(requests, limits.prompt_chars_limit(service.max_seq_len))
    if len(requests) > service.max_batch_size:
        raise InvalidRequest(f"batch size {len(requests)} is larger than the model's max_batch_size "
                             f"{service.max_batch_size}", "text_input")
    names, binary_names = requested_outputs(header.get("outputs"), flag(parameters, "binary_data_output"))
    names = check_requested_outputs(names, requests)
    async with with_loras(service, requests) as requests:
        results = await complete_all(service, requests, limits)
    outputs = make_outputs(names, results, pad_ids(requests, service.llm.eos_token_ids))
    response = _infer_response(request_id, name, outputs, binary_names)
    response.enable_compression()  # only when the client's Accept-Encoding asks for it
    return response


def _infer_response(request_id: str | None, model: str, outputs: dict[str, np.ndarray],
                    binary_names: set[str] | None) -> web.Response:
    """JSON, or with binary outputs the JSON header then their bytes (binary_names None: all binary)."""
    body, binary = infer_response_body(request_id, model, outputs, binary_names)
    if not binary:
        return web.json_response(body)
    head = json.dumps(body).encode()
    return web.Response(body=head + binary, content_type="application/octet-stream",
                        headers={BINARY_HEADER: str(len(head))})


async def _read_infer_body(request: web.Request) -> tuple[dict, bytes]:
    """-> (the JSON header, the binary tensor data after it)."""
    length = request.headers.get(BINARY_HEADER)
    if length is None:
        return await read_json(request), b""
    raw = await read_request_body(request)
    if not length.isdigit() or int(length) > len(raw):
        raise InvalidRequest(f"header {BINARY_HEADER}: {length!r} is not a length within the body "
                             f"({len(raw)} bytes)")
    head, binary = raw[:int(length)], raw[int(length):]
    check_json_containers(head)
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise long_integer_error(head) or InvalidRequest(f"the inference header (the first {length} bytes) is not "
                                                         f"valid JSON: {e}") from None
    return json_object(header, "the inference header"), binary


# ---- generate extension ----------------------------------------------------------------------------
def _generate_request(body: dict) -> TritonRequest:
    """`{input name: scalar or list, ..., "parameters": {...}}` -> one request. Parameters that name an input
    are that input (as in Triton's example `"parameters": {"temperature": 0}`); others are ignored."""
    fields = dict(body)
    for key, value in json_object(fields.pop("parameters", None), "'parameters'").items():
        if key in INPUT_SPECS:
            if key in fields:
                raise InvalidRequest(f"'{key}' is given twice: as a field and in 'parameters'", key)
            fields[key] = value
    arrays = {}
    for key, value in fields.items():
        spec = INPUT_SPECS.get(key)
        if spec is None:
            raise InvalidRequest(f"unknown field '{key}'; the fields are this model's inputs "
                                 f"({', '.join(INPUT_SPECS)}) and 'parameters'", key)
        if len(spec.dims) == 2:  # a matrix (lora_weights, lora_config): a list of equal-length lists
            arrays[key] = _matrix(key, spec.datatype, value)[None]
        else:
            arrays[key] = from_json(key, spec.datatype, value if isinstance(value, list) else [value]).reshape(1, -1)
    return parse_request(arrays)[0]


def _matrix(key: str, datatype: str, value) -> np.ndarray:
    if not isinstance(value, list) or not value or not all(isinstance(r, list) for r in value) \
            or len({len(r) for r in value}) != 1:
        raise InvalidRequest(f"'{key}' must be a non-empty list of rows (lists) of one length", key)
    return from_json(key, datatype, [v for r in value for v in r]).reshape(len(value), len(value[0]))


def _checked_generate_request(request: web.Request, body: dict) -> TritonRequest:
    """The generate extension's request, its text_input within --max-prompt-chars."""
    generate_request = _generate_request(body)
    limits = RequestLimits.from_config(request.app[CONFIG])
    check_prompt_sizes([generate_request], limits.prompt_chars_limit(request.app[SERVICE].max_seq_len))
    check_beam_widths(request.app[SERVICE].llm, [generate_request])
    return generate_request


def _generate_body(model: str, request: TritonRequest, beams: list[Beam]) -> dict:
    """The generate extension's JSON: a value per output, or with beam search a list of them, one per beam (as
    Triton gives a tensor of several elements)."""
    def value(values: list):
        return values[0] if request.beam_width == 1 else values

    body = {"model_name": model, "model_version": MODEL_VERSION, "text_output": value([b.text for b in beams])}
    if request.return_log_probs:
        body.update(output_log_probs=value([list(b.logprobs) for b in beams]),
                    cum_log_probs=value([sum(b.logprobs) if b.cum_log_prob is None else b.cum_log_prob
                                         for b in beams]))
    body.update(generate_fields(beams, request.beam_width == 1))  # logits and perf metrics, when asked
    return body


async def _generate(request: web.Request) -> web.Response:
    name = _model_name(request)
    generate_request = _checked_generate_request(request, await read_json(request))
    async with with_loras(request.app[SERVICE], [generate_request]) as (generate_request,):
        beams = await complete(request.app[SERVICE], generate_request)
    return web.json_response(_generate_body(name, generate_request, beams))


async def _generate_stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events, one per new piece of text (never the prompt); the last one when finished. With beam
    search, one per update, holding the current beams whole (their generated text). An error before the first
    piece is an ordinary error response; after it, an event `{"error": ...}`."""
    name = _model_name(request)
    service = request.app[SERVICE]
    async with with_loras(service, [_checked_generate_request(request, await read_json(request))]) as rows:
        return await _stream_events(request, name, service, rows[0])


async def _stream_events(request: web.Request, name: str, service, generate_request: TritonRequest) \
        -> web.StreamResponse:
    """`_generate_stream`'s events for one request (the caller holds its LoRA adapter in use)."""
    stream = service.generate(generate_request.prompt, generate_request.params, cut_off_is_error=True,
                              guided_field=TRITON_GUIDE_LABEL, lora_request=generate_request.lora_request)
    async with contextlib.aclosing(stream) as stream:
        delta = await anext(stream)  # raises InvalidRequest (too long, ...) before any event
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        cum_log_prob = 0.0
        first = True  # the first event carries the context logits (when asked)
        try:
            while True:
                cum_log_prob += sum(delta.logprobs)
                if delta.beams is not None:
                    event = _generate_body(name, generate_request, beams_of(generate_request, delta.output, False))
                    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                elif delta.text or delta.finished or (generate_request.return_log_probs and delta.logprobs):
                    beam = Beam(delta.text, delta.token_ids, delta.logprobs, cum_log_prob,
                                **streamed(delta.output, len(delta.token_ids), first))
                    event = _generate_body(name, generate_request, [beam])
                    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    first = False
                if delta.finished:
                    break
                delta = await anext(stream)
        except ConnectionResetError:  # the client went away; leaving `aclosing` aborts the request
            return response
        except Exception as e:  # the 200 status line is sent: report it in the stream
            message = e.message if isinstance(e, RequestError) else f"internal error: {e}"
            if not isinstance(e, RequestError):
                logger.exception("generate_stream failed after it started streaming")
            with contextlib.suppress(ConnectionResetError):
                await response.write(b"data: " + json.dumps({"error": message}).encode() + b"\n\n")
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response

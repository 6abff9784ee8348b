"""Triton / KServe v2 over HTTP: health, metadata, config, infer, generate and generate_stream.

One model (`service.model_name`, version "1"). `infer` speaks Triton's binary tensor data extension both
ways, as `tritonclient.http` does by default: a request whose header `Inference-Header-Content-Length: N`
says its first N bytes are the JSON header and the rest the raw tensors of the inputs that carry
`parameters.binary_data_size`, in input order (BYTES elements as a 4-byte little-endian length, then the
bytes). Every row of an `infer` batch is its own engine request; all rows run at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math

import numpy as np
from aiohttp import web

import kiln

from .client_json import long_integer_error, shown
from .errors import InvalidRequest, NotFound, RequestError
from .http_body import check_json_containers
from .http_common import CONFIG, SERVICE, read_json, read_request_body
from .limits import RequestLimits
from .triton_batch import complete, complete_all
from .triton_request import (
    TritonRequest,
    check_datatype,
    check_requested_outputs,
    make_outputs,
    parse_request,
)
from .triton_schema import (
    DATATYPES,
    INPUT_SPECS,
    MODEL_VERSION,
    OUTPUT_SPECS,
    model_config,
    model_config_json,
    model_metadata,
)
from .triton_wire import check_shape, decode_raw, encode_raw, object_array, utf8

logger = logging.getLogger("kiln.serve")

BINARY_HEADER = "Inference-Header-Content-Length"
EXTENSIONS = ("binary_tensor_data", "model_configuration", "generate", "parameters")
_INT_RANGES = {"INT32": (-2**31, 2**31), "INT64": (-2**63, 2**63), "UINT64": (0, 2**64)}


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
    parameters = _object(header.get("parameters"), "parameters")
    service = request.app[SERVICE]
    limits = RequestLimits.from_config(request.app[CONFIG])
    requests = parse_request(_input_arrays(header.get("inputs"), binary), limits)
    if len(requests) > service.max_batch_size:
        raise InvalidRequest(f"batch size {len(requests)} is larger than the model's max_batch_size "
                             f"{service.max_batch_size}", "text_input")
    names, binary_names = _requested_outputs(header.get("outputs"), _flag(parameters, "binary_data_output"))
    names = check_requested_outputs(names, requests)
    results = await complete_all(service, requests, limits)
    outputs = make_outputs(names, [text for text, _ in results], [lp for _, lp in results])
    response = _infer_response(request_id, name, outputs, binary_names)
    response.enable_compression()  # only when the client's Accept-Encoding asks for it
    return response


def _infer_response(request_id: str | None, model: str, outputs: dict[str, np.ndarray],
                    binary_names: set[str] | None) -> web.Response:
    """JSON, or with binary outputs the JSON header then their bytes (binary_names None: all binary)."""
    body = {"id": request_id} if request_id is not None else {}
    body.update(model_name=model, model_version=MODEL_VERSION, outputs=[])
    chunks = []
    for name, array in outputs.items():
        datatype = OUTPUT_SPECS[name].datatype
        tensor = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary_names is None or name in binary_names:
            raw = encode_raw(datatype, array)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = ([v.decode("utf-8") for v in array.flat] if datatype == "BYTES"
                              else array.ravel().tolist())
        body["outputs"].append(tensor)
    if not chunks:
        return web.json_response(body)
    head = json.dumps(body).encode()
    return web.Response(body=head + b"".join(chunks), content_type="application/octet-stream",
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
    return _object(header, "the inference header"), binary


def _input_arrays(inputs, binary: bytes) -> dict[str, np.ndarray]:
    """The request's `inputs` -> named arrays of their shapes (BYTES as object arrays of bytes)."""
    if not isinstance(inputs, list) or not inputs:
        raise InvalidRequest("the request needs 'inputs': a non-empty list of tensors", "inputs")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InvalidRequest(f"inputs[{i}] must be an object with a string 'name'", "inputs")
        name, datatype = tensor["name"], tensor.get("datatype")
        check_datatype(name, datatype)
        if name in arrays:
            raise InvalidRequest(f"input '{name}' is given twice", name)
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise InvalidRequest(f"input '{name}' needs 'shape': a list of sizes >= 0, got {json.dumps(shape)}",
                                 name)
        parameters = _object(tensor.get("parameters"), f"input '{name}' parameters")
        if "shared_memory_region" in parameters:
            raise InvalidRequest(f"input '{name}': shared memory is not supported; send the data", name)
        size = parameters.get("binary_data_size")
        if size is not None:
            if "data" in tensor:
                raise InvalidRequest(f"input '{name}' has both 'data' and binary_data_size", name)
            if not _is_int(size) or not 0 <= size <= len(binary) - offset:
                raise InvalidRequest(f"input '{name}': binary_data_size {size} does not fit the "
                                     f"{len(binary) - offset} bytes of binary data left", name)
            arrays[name] = decode_raw(name, datatype, binary[offset:offset + size], shape, where="binary data")
            offset += size
        else:
            arrays[name] = _json_tensor(name, datatype, tensor, shape)
    if offset != len(binary):
        raise InvalidRequest(f"{len(binary) - offset} bytes of binary data after the inference header belong "
                             f"to no input (check binary_data_size)")
    return arrays


def _json_tensor(name: str, datatype: str, tensor: dict, shape: list[int]) -> np.ndarray:
    """An input's JSON `data` -> an array of its shape."""
    if "data" not in tensor:
        raise InvalidRequest(f"input '{name}' has no 'data' (and no binary_data_size)", name)
    if not isinstance(tensor["data"], list):
        raise InvalidRequest(f"input '{name}': 'data' must be a list", name)
    check_shape(name, shape)
    values = _from_json(name, datatype, _flatten(tensor["data"]))
    if values.size != math.prod(shape):
        raise InvalidRequest(f"input '{name}' has shape {shape} ({math.prod(shape)} elements) but "
                             f"{values.size} values", name)
    return values.reshape(shape)


def _requested_outputs(outputs, binary_default: bool) -> tuple[list[str], set[str] | None]:
    """-> (output names, those to send as binary data; None: all of them)."""
    if outputs is None:
        return [], (None if binary_default else set())
    if not isinstance(outputs, list):
        raise InvalidRequest("'outputs' must be a list of objects with a 'name'", "outputs")
    names, binary = [], set()
    for i, output in enumerate(outputs):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidRequest(f"outputs[{i}] must be an object with a string 'name'", "outputs")
        name = output["name"]
        parameters = _object(output.get("parameters"), f"output '{name}' parameters")
        for unsupported in ("classification", "shared_memory_region"):
            if unsupported in parameters:
                raise InvalidRequest(f"output '{name}': parameter '{unsupported}' is not supported", name)
        names.append(name)
        if _flag(parameters, "binary_data", binary_default):
            binary.add(name)
    return names, binary


# ---- tensor data -----------------------------------------------------------------------------------
def _from_json(name: str, datatype: str, values: list) -> np.ndarray:
    """JSON values -> a flat array, each value checked against the datatype."""
    for value in values:
        if datatype == "BOOL":
            ok = isinstance(value, bool)
        elif datatype == "FP32":
            # an integer beyond float32's range is no FP32 value (and float() overflows on a long one)
            ok = isinstance(value, float) or (_is_int(value) and abs(value) < 2**128)
        elif datatype == "BYTES":
            ok = isinstance(value, str)
        else:
            low, high = _INT_RANGES[datatype]
            ok = _is_int(value) and low <= value < high
        if not ok:
            raise InvalidRequest(f"input '{name}' is {datatype}; {shown(value)} is not a {datatype} value", name)
    if datatype == "BYTES":
        return object_array([utf8(name, v) for v in values])
    return np.array(values, dtype=DATATYPES[datatype][1])


def _flatten(data: list) -> list:
    """Row-major values of nested lists (KServe allows `data` flat or nested by shape); no recursion, so
    any nesting that JSON parsing allowed is fine."""
    flat, stack = [], [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(value, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {json.dumps(value)[:80]}")
    return value


def _flag(parameters: dict, key: str, default: bool = False) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"parameter '{key}' must be true or false, got {json.dumps(value)}", key)
    return value


# ---- generate extension ----------------------------------------------------------------------------
def _generate_request(body: dict) -> TritonRequest:
    """`{input name: scalar or list, ..., "parameters": {...}}` -> one request. Parameters that name an input
    are that input (as in Triton's example `"parameters": {"temperature": 0}`); others are ignored."""
    fields = dict(body)
    for key, value in _object(fields.pop("parameters", None), "'parameters'").items():
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
        arrays[key] = _from_json(key, spec.datatype, value if isinstance(value, list) else [value]).reshape(1, -1)
    return parse_request(arrays)[0]


def _generate_body(model: str, request: TritonRequest, text: str, logprobs: list[float],
                   cum_log_prob: float) -> dict:
    body = {"model_name": model, "model_version": MODEL_VERSION, "text_output": text}
    if request.return_log_probs:
        body.update(output_log_probs=logprobs, cum_log_probs=cum_log_prob)
    return body


async def _generate(request: web.Request) -> web.Response:
    name = _model_name(request)
    generate_request = _generate_request(await read_json(request))
    text, logprobs = await complete(request.app[SERVICE], generate_request)
    return web.json_response(_generate_body(name, generate_request, text, logprobs, sum(logprobs)))


async def _generate_stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events, one per new piece of text (never the prompt); the last one when finished. An error
    before the first piece is an ordinary error response; after it, an event `{"error": ...}`."""
    name = _model_name(request)
    generate_request = _generate_request(await read_json(request))
    service = request.app[SERVICE]
    async with contextlib.aclosing(service.generate(generate_request.prompt, generate_request.params,
                                                    cut_off_is_error=True)) as stream:
        delta = await anext(stream)  # raises InvalidRequest (too long, ...) before any event
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        cum_log_prob = 0.0
        try:
            while True:
                if delta.text or delta.finished or (generate_request.return_log_probs and delta.logprobs):
                    cum_log_prob += sum(delta.logprobs)
                    event = _generate_body(name, generate_request, delta.text, delta.logprobs, cum_log_prob)
                    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
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

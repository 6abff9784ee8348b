"""KServe v2 tensors over HTTP <-> numpy: an `infer` request's `inputs` (JSON `data` or Triton's binary tensor
data extension) to named arrays, its `outputs` to the names to send, and arrays back to a response body.

Binary tensor data: the request's header `Inference-Header-Content-Length: N` says its first N bytes are the
JSON header and the rest the raw tensors of the inputs that carry `parameters.binary_data_size`, in input
order (BYTES elements as a 4-byte little-endian length, then the bytes); responses use the same layout.
Every problem raises `InvalidRequest` naming the tensor. No aiohttp here: `kserve_http` reads and answers.
"""

from __future__ import annotations

import json
import math

import numpy as np

from kiln.serve.client_json import shown
from kiln.serve.errors import InvalidRequest
from kiln.serve.tritonserver.request import check_datatype
from kiln.serve.tritonserver.schema import DATATYPES, MODEL_VERSION, OUTPUT_SPECS
from kiln.serve.tritonserver.wire import check_shape, decode_raw, encode_raw, object_array, utf8

BINARY_HEADER = "Inference-Header-Content-Length"
_INT_RANGES = {"INT32": (-2**31, 2**31), "INT64": (-2**63, 2**63), "UINT64": (0, 2**64)}


def input_arrays(inputs, binary: bytes) -> dict[str, np.ndarray]:
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
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise InvalidRequest(f"input '{name}' needs 'shape': a list of sizes >= 0, got {json.dumps(shape)}",
                                 name)
        parameters = json_object(tensor.get("parameters"), f"input '{name}' parameters")
        if "shared_memory_region" in parameters:
            raise InvalidRequest(f"input '{name}': shared memory is not supported; send the data", name)
        size = parameters.get("binary_data_size")
        if size is not None:
            if "data" in tensor:
                raise InvalidRequest(f"input '{name}' has both 'data' and binary_data_size", name)
            if not is_int(size) or not 0 <= size <= len(binary) - offset:
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
    values = from_json(name, datatype, _flatten(tensor["data"]))
    if values.size != math.prod(shape):
        raise InvalidRequest(f"input '{name}' has shape {shape} ({math.prod(shape)} elements) but "
                             f"{values.size} values", name)
    return values.reshape(shape)


def requested_outputs(outputs, binary_default: bool) -> tuple[list[str], set[str] | None]:
    """The request's `outputs` -> (output names, those to send as binary data; None: all of them)."""
    if outputs is None:
        return [], (None if binary_default else set())
    if not isinstance(outputs, list):
        raise InvalidRequest("'outputs' must be a list of objects with a 'name'", "outputs")
    names, binary = [], set()
    for i, output in enumerate(outputs):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidRequest(f"outputs[{i}] must be an object with a string 'name'", "outputs")
        name = output["name"]
        parameters = json_object(output.get("parameters"), f"output '{name}' parameters")
        for unsupported in ("classification", "shared_memory_region"):
            if unsupported in parameters:
                raise InvalidRequest(f"output '{name}': parameter '{unsupported}' is not supported", name)
        names.append(name)
        if flag(parameters, "binary_data", binary_default):
            binary.add(name)
    return names, binary


def infer_response_body(request_id: str | None, model: str, outputs: dict[str, np.ndarray],
                        binary_names: set[str] | None) -> tuple[dict, bytes]:
    """-> (the JSON body, the binary data to send after it: empty when every output is JSON `data`).
    `binary_names` None: every output is binary."""
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
    return body, b"".join(chunks)


def from_json(name: str, datatype: str, values: list) -> np.ndarray:
    """JSON values -> a flat array, each value checked against the datatype."""
    for value in values:
        if datatype == "BOOL":
            ok = isinstance(value, bool)
        elif datatype in ("FP32", "FP16"):
            # an integer beyond float32's range is no FP32 value (and float() overflows on a long one)
            ok = isinstance(value, float) or (is_int(value) and abs(value) < 2**128)
        elif datatype == "BYTES":
            ok = isinstance(value, str)
        else:
            low, high = _INT_RANGES[datatype]
            ok = is_int(value) and low <= value < high
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


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_object(value, what: str) -> dict:
    """`value` if it is a JSON object, {} if absent; InvalidRequest naming `what` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {json.dumps(value)[:80]}")
    return value


def flag(parameters: dict, key: str, default: bool = False) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"parameter '{key}' must be true or false, got {json.dumps(value)}", key)
    return value

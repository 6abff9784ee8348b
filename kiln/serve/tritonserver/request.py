"""Triton tensors <-> kiln requests: named numpy arrays in, one `TritonRequest` per batch row; outputs back.

Shared by the HTTP and gRPC front ends and by the Python-backend `model.py` of `kiln triton-repo`.
Every problem raises `InvalidRequest` naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kiln.runtime import LoRARequest
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.errors import InvalidRequest
from kiln.serve.guided_request import GUIDE_INPUT, GUIDE_TYPE_INPUT, triton_guided
from kiln.serve.limits import check_prompt_chars
from kiln.serve.tritonserver.lora_tasks import TritonLoRA, parse_lora
from kiln.serve.tritonserver.schema import DATATYPES, INPUT_SPECS, OUTPUT_SPECS

if TYPE_CHECKING:
    from kiln.serve.limits import RequestLimits


@dataclass(frozen=True)
class TritonRequest:
    """One row of a Triton request, ready for the engine."""

    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    return_log_probs: bool
    lora: TritonLoRA | None = None  # TensorRT-LLM's lora_task_id (+ lora_weights, lora_config) as sent
    lora_request: LoRARequest | None = None  # the adapter it selects, once resolved (lora_tasks.py)


def check_datatype(name: str, datatype: str) -> None:
    """A request's declared datatype must be the model's (Triton rejects a mismatch the same way)."""
    spec = INPUT_SPECS.get(name)
    if spec is None:
        raise InvalidRequest(f"unknown input '{name}'; this model's inputs are {', '.join(INPUT_SPECS)}", name)
    if datatype != spec.datatype:
        raise InvalidRequest(f"input '{name}' has datatype {datatype}; the model expects {spec.datatype}", name)


def _rows(name: str, array: np.ndarray) -> np.ndarray:
    """-> [B, n]: shape [B, n] as is; [n] is one row. A matrix per row (lora_weights, lora_config): -> [B, n, m];
    [n, m] is one row."""
    if len(INPUT_SPECS[name].dims) == 2:
        array = array[None] if array.ndim == 2 else array
        if array.ndim != 3:
            raise InvalidRequest(f"input '{name}' has shape {list(array.shape)}; expected [batch, n, m]", name)
        return array
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2:
        raise InvalidRequest(f"input '{name}' has shape {list(array.shape)}; expected [batch, "
                             f"{'n' if INPUT_SPECS[name].dims == (-1,) else 1}]", name)
    if INPUT_SPECS[name].dims == (1,) and array.shape[1] != 1:
        raise InvalidRequest(f"input '{name}' has shape {list(array.shape)}; expected [batch, 1]", name)
    return array


def _text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' is not valid UTF-8", name) from None
    except TypeError:
        raise InvalidRequest(f"input '{name}' must hold strings, got {type(value).__name__}", name) from None


def _scalar(name: str, value):
    kind = INPUT_SPECS[name].datatype
    try:
        if kind == "BOOL":
            return bool(value)
        if kind == "FP32":
            return float(value)
        return int(value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"input '{name}' must be {kind}, got {value!r}", name) from None


_FIELD = re.compile(r"SamplingParams\.(\w+)=")
_PARAM_TO_INPUT = {"seed": "seed", "stop": "stop_words", "stop_token_ids": "end_id"}


def parse_request(inputs: Mapping[str, np.ndarray], limits: RequestLimits | None = None) -> list[TritonRequest]:
    """Named arrays (BYTES as object arrays of bytes/str) -> one TritonRequest per batch row. With `limits`, a
    batch of more rows than the server takes is refused before any row is parsed."""
    for name in inputs:
        if name not in INPUT_SPECS:
            raise InvalidRequest(f"unknown input '{name}'; this model's inputs are {', '.join(INPUT_SPECS)}", name)
    for name, spec in INPUT_SPECS.items():
        if not spec.optional and name not in inputs:
            raise InvalidRequest(f"missing required input '{name}'", name)
    rows = {name: _rows(name, np.asarray(array)) for name, array in inputs.items()}
    batch = rows["text_input"].shape[0]
    if batch == 0:
        raise InvalidRequest("input 'text_input' is empty (batch size 0)", "text_input")
    if limits is not None:
        limits.check_rows(batch)
    for name, array in rows.items():
        if array.shape[0] != batch:
            raise InvalidRequest(f"input '{name}' has batch size {array.shape[0]} but text_input has {batch}", name)
    return [_parse_row({name: array[i] for name, array in rows.items()}) for i in range(batch)]


def _parse_row(row: Mapping[str, np.ndarray]) -> TritonRequest:
    scalars = {name: _scalar(name, values[0]) for name, values in row.items()
               if INPUT_SPECS[name].dims == (1,) and INPUT_SPECS[name].datatype != "BYTES"}
    prompt = _text("text_input", row["text_input"][0])
    stop = tuple(s for s in (_text("stop_words", v) for v in row.get("stop_words", ())) if s)
    if any(_text("bad_words", v) for v in row.get("bad_words", ())):
        raise InvalidRequest("input 'bad_words' is not supported (send it empty)", "bad_words")
    if scalars.get("beam_width", 1) != 1:
        raise InvalidRequest(f"input 'beam_width' is {scalars['beam_width']}; only 1 is supported", "beam_width")
    if "seed" in scalars and "random_seed" in scalars:
        raise InvalidRequest("give one of the inputs 'seed' and 'random_seed', not both", "random_seed")
    seed = scalars.get("seed", scalars.get("random_seed"))
    top_p = scalars.get("top_p")
    if top_p == 0.0:  # TensorRT-LLM's "off"
        top_p = None
    sampling = "top_k" in scalars or top_p is not None
    kwargs = dict(
        max_tokens=scalars["max_tokens"],
        temperature=scalars.get("temperature", 1.0 if sampling else 0.0),
        top_k=scalars.get("top_k", 0), top_p=1.0 if top_p is None else top_p, min_p=scalars.get("min_p", 0.0),
        repetition_penalty=scalars.get("repetition_penalty", 1.0),
        presence_penalty=scalars.get("presence_penalty", 0.0),
        frequency_penalty=scalars.get("frequency_penalty", 0.0),
        seed=seed, stop=stop, logprobs=scalars.get("return_log_probs", False),
    )
    if "end_id" in scalars:  # the request's end token replaces the model's EOS
        kwargs.update(stop_token_ids=(scalars["end_id"],), ignore_eos=True)
    lora = parse_lora(scalars.get("lora_task_id"), row.get("lora_weights"), row.get("lora_config"))
    guides = {name: _text(name, row[name][0]) if name in row else None for name in (GUIDE_TYPE_INPUT, GUIDE_INPUT)}
    kwargs["guided_decoding"] = triton_guided(guides[GUIDE_TYPE_INPUT], guides[GUIDE_INPUT])
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        match = _FIELD.match(str(e))
        field = match.group(1) if match else None
        name = _PARAM_TO_INPUT.get(field, field)
        raise InvalidRequest(f"input '{name}': {e}" if name else str(e), name) from None
    return TritonRequest(prompt=prompt, params=params, stream=scalars.get("stream", False),
                         exclude_input=scalars.get("exclude_input_in_output", False),
                         return_log_probs=scalars.get("return_log_probs", False), lora=lora)


def check_prompt_sizes(requests: Sequence[TritonRequest], limit: int, setting: str = "--max-prompt-chars") -> None:
    """Every row's text_input against the character cap of one prompt, before anything is tokenized; `setting`
    is what raises the cap (the kiln serve flag, or the Triton model's config.pbtxt parameter)."""
    for i, request in enumerate(requests):
        what = "input 'text_input'" if len(requests) == 1 else f"batch row {i}: input 'text_input'"
        check_prompt_chars(what, len(request.prompt), limit, "text_input", setting)


def check_requested_outputs(names: Sequence[str], requests: Sequence[TritonRequest]) -> list[str]:
    """The outputs to send: those asked for (all that apply when none are named).

    A log-prob output asked for without the input return_log_probs is sent, not refused, as TensorRT-LLM's
    backend does: tools such as perf_analyzer and genai-perf ask for every output the metadata lists. Its
    values are then not computed: output_log_probs has no entries and cum_log_probs is 0 (see make_outputs)."""
    if not names:
        logprobs = all(r.return_log_probs for r in requests)
        return ["text_output", *(["output_log_probs", "cum_log_probs"] if logprobs else [])]
    for name in names:
        if name not in OUTPUT_SPECS:
            raise InvalidRequest(f"unknown output '{name}'; this model's outputs are {', '.join(OUTPUT_SPECS)}",
                                 name)
    return list(names)


def make_outputs(names: Sequence[str], texts: Sequence[str],
                 logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, np.ndarray]:
    """One row per request: text_output [B, 1] BYTES, output_log_probs [B, N] FP32 (rows padded with 0),
    cum_log_probs [B, 1] FP32. A request without return_log_probs has no logprobs: its row of
    output_log_probs is all padding ([B, 0] when no row has any) and its cum_log_probs 0."""
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name == "text_output":
            out[name] = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        elif name == "output_log_probs":
            width = max((len(lp) for lp in logprobs), default=0)
            array = np.zeros((len(logprobs), width), dtype=np.float32)
            for i, lp in enumerate(logprobs):
                array[i, :len(lp)] = lp
            out[name] = array
        elif name == "cum_log_probs":
            out[name] = np.array([[sum(lp)] for lp in logprobs], dtype=np.float32)
    return out


def numpy_dtype(datatype: str):
    return DATATYPES[datatype][1]

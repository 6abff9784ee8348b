"""Triton tensors <-> kiln requests: named numpy arrays in, one `TritonRequest` per batch row; outputs back.

Shared by the HTTP and gRPC front ends and by the Python-backend `model.py` of `kiln triton-repo`.
Every problem raises `InvalidRequest` naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.runtime import LoRARequest
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.serve.errors import InvalidRequest
from kiln.serve.guided_request import GUIDE_INPUT, GUIDE_TYPE_INPUT, triton_guided
from kiln.serve.limits import check_prompt_chars
from kiln.serve.tritonserver.logits_outputs import EXTRA_OUTPUTS, PERF_OUTPUTS, extra_output
from kiln.serve.tritonserver.lora_tasks import TritonLoRA, parse_lora
from kiln.serve.tritonserver.schema import DATATYPES, INPUT_SPECS, OUTPUT_SPECS
from kiln.serve.tritonserver.word_lists import word_list_kwargs

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
    num_return_sequences: int = 1  # the beams to send (all of a beam search's unless num_return_sequences says)
    pad_id: int | None = None  # what pads output_ids: pad_id, else end_id (None: the model's EOS)

    @property
    def beam_width(self) -> int:
        """Beams of its beam search; 1 without one."""
        return max(1, self.params.beam_width)


@dataclass(frozen=True)
class Beam:
    """One returned sequence of a row (the row's only one without beam search): its text_output, its output_ids
    and the generated tokens' logprobs (empty unless return_log_probs)."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[float] = ()
    cum_log_prob: float | None = None  # None: the sum of logprobs
    generation_logits: Any = None  # [len, V] float32 torch.Tensor of the generated tokens, when asked
    # The row's (each of its beams holds the same): context logits [prompt, V] and perf metrics, when asked
    context_logits: Any = None
    perf_metrics: Any = None


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
# Inputs that are SamplingParams fields of the same name (what they fill: logits_outputs.py).
_EXTRA_FLAGS = ("return_context_logits", "return_generation_logits", "return_perf_metrics")
_PARAM_TO_INPUT = {"seed": "seed", "stop": "stop_words", "stop_token_ids": "end_id", "bad_words": "bad_words",
                   "bad_words_token_ids": "bad_words_list", "stop_token_sequences": "stop_words_list",
                   "logit_bias": "embedding_bias", "n": "beam_width",
                   "length_penalty": "len_penalty"}


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
    beam_kwargs, returned = _beam_search(scalars)
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
    kwargs.update({name: scalars[name] for name in _EXTRA_FLAGS if name in scalars})  # logits, perf metrics
    if "end_id" in scalars:  # the request's end token replaces the model's EOS
        kwargs.update(stop_token_ids=(scalars["end_id"],), ignore_eos=True)
    kwargs.update(beam_kwargs)
    kwargs.update(word_list_kwargs(row, _text))  # bad_words, bad_words_list, stop_words_list, embedding_bias
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
                         return_log_probs=scalars.get("return_log_probs", False), lora=lora,
                         num_return_sequences=returned, pad_id=scalars.get("pad_id", scalars.get("end_id")))


def _beam_search(scalars: Mapping[str, object]) -> tuple[dict, int]:
    """beam_width, num_return_sequences, len_penalty (length_penalty) and early_stopping -> (SamplingParams'
    beam-search fields, how many beams to return). beam_width 1 (the default) is no beam search; the width is
    checked against the engine's max_beam_width where the engine is known (serve/beams.py)."""
    width = scalars.get("beam_width", 1)
    if width < 1:
        raise InvalidRequest(f"input 'beam_width' is {width}; it must be >= 1 (1: no beam search)", "beam_width")
    if "len_penalty" in scalars and "length_penalty" in scalars:
        raise InvalidRequest("give one of the inputs 'len_penalty' and 'length_penalty', not both", "length_penalty")
    returned = scalars.get("num_return_sequences", width)
    if not 1 <= returned <= width:
        raise InvalidRequest(f"input 'num_return_sequences' is {returned}; it must be in [1, beam_width={width}] "
                             "(the best beams of a beam search; kiln has no parallel sampling, so 1 without beams)",
                             "num_return_sequences")
    if width == 1:
        return {}, 1
    penalty = scalars.get("len_penalty", scalars.get("length_penalty", 1.0))
    return dict(use_beam_search=True, n=width, length_penalty=penalty,
                early_stopping=scalars.get("early_stopping", False)), returned


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
        extras = [name for flag, names in (("return_context_logits", ["context_logits"]),
                                           ("return_generation_logits", ["generation_logits"]),
                                           ("return_perf_metrics", list(PERF_OUTPUTS)))
                  if any(getattr(r.params, flag) for r in requests) for name in names]
        return ["text_output", *(["output_log_probs", "cum_log_probs"] if logprobs else []), *extras]
    for name in names:
        if name not in OUTPUT_SPECS:
            raise InvalidRequest(f"unknown output '{name}'; this model's outputs are {', '.join(OUTPUT_SPECS)}",
                                 name)
    return list(names)


def make_outputs(names: Sequence[str], rows: Sequence[Sequence[Beam]],
                 pad_ids: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Each row's beams (one without beam search; rows with fewer beams than the widest are padded with empty
    ones) -> TensorRT-LLM's shapes: text_output [B, beam] BYTES, output_log_probs [B, beam, N] FP32 (padded with
    0), cum_log_probs [B, beam] FP32, output_ids [B, beam, L] INT32 (padded with the row's `pad_ids`, 0 when not
    given), sequence_length [B, beam] INT32. A row without return_log_probs has empty logprobs: its
    output_log_probs are all padding and its cum_log_probs 0."""
    width = max((len(beams) for beams in rows), default=1)
    grid = [list(beams) + [Beam("", ())] * (width - len(beams)) for beams in rows]
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name == "text_output":
            array = np.empty((len(grid), width), dtype=np.object_)
            for i, beams in enumerate(grid):
                for j, b in enumerate(beams):
                    array[i, j] = b.text.encode("utf-8")
            out[name] = array
        elif name == "output_log_probs":
            out[name] = _padded([[b.logprobs for b in beams] for beams in grid], np.float32, [0.0] * len(grid))
        elif name == "cum_log_probs":
            out[name] = np.array([[sum(b.logprobs) if b.cum_log_prob is None else b.cum_log_prob for b in beams]
                                  for beams in grid], dtype=np.float32).reshape(len(grid), width)
        elif name == "output_ids":
            out[name] = _padded([[b.token_ids for b in beams] for beams in grid], np.int32,
                                list(pad_ids) if pad_ids is not None else [0] * len(grid))
        elif name == "sequence_length":
            out[name] = np.array([[len(b.token_ids) for b in beams] for beams in grid],
                                 dtype=np.int32).reshape(len(grid), width)
        elif name in EXTRA_OUTPUTS:  # logits and perf metrics (zeros for a row that did not ask)
            out[name] = extra_output(name, grid)
    return out


def _padded(rows: Sequence[Sequence[Sequence]], dtype, pads: Sequence) -> np.ndarray:
    """[B][beam][n] ragged values -> a [B, beam, N] array, row i padded with pads[i]."""
    width = max((len(beams) for beams in rows), default=1)
    length = max((len(values) for beams in rows for values in beams), default=0)
    array = np.zeros((len(rows), width, length), dtype=dtype)
    for i, beams in enumerate(rows):
        array[i] = pads[i]
        for j, values in enumerate(beams):
            array[i, j, :len(values)] = values
    return array


def numpy_dtype(datatype: str):
    return DATATYPES[datatype][1]


def pad_ids(rows: Sequence[TritonRequest], eos_token_ids) -> list[int]:
    """What pads each row's output_ids: its pad_id, else its end_id, else the model's (lowest) EOS id."""
    eos = min(eos_token_ids, default=0)
    return [eos if row.pad_id is None else row.pad_id for row in rows]

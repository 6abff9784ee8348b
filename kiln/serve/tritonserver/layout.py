"""TensorRT-LLM backend's ensemble layout, as one table: its five models, their tensors and how they connect.

`kiln triton-repo --layout ensemble` writes TensorRT-LLM's `all_models/inflight_batcher_llm` models, all backed
by one kiln engine (held by `tensorrt_llm`):

    preprocessing     text_input, max_tokens, stop/bad words, end_id, pad_id -> token ids (the engine's tokenizer)
    tensorrt_llm      token ids in, token ids out (input_ids, input_lengths, request_output_len, ... ->
                      output_ids, sequence_length, cum_log_probs, output_log_probs): the engine
    postprocessing    output_ids -> text (the engine's tokenizer)
    ensemble          Triton's ensemble scheduling: preprocessing -> tensorrt_llm -> postprocessing
    tensorrt_llm_bls  a Python BLS model running the same three steps, streaming text that decodes whole

The client inputs of `ensemble` and `tensorrt_llm_bls` are the single model's (schema.INPUTS) under the same
names; each goes to preprocessing (PREPROCESSED, under its TensorRT-LLM name there) or to tensorrt_llm (renamed
by TRTLLM_NAMES). STEP_WIRING says which output of a step feeds which input of the next. The ensemble's steps
and the BLS model's calls are both made from these tables, so the two paths cannot drift, and an input added
to schema.INPUTS reaches tensorrt_llm through both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kiln.serve.tritonserver.schema import DATATYPES, INPUTS, TensorSpec

PREPROCESSING, TENSORRT_LLM, POSTPROCESSING = "preprocessing", "tensorrt_llm", "postprocessing"
ENSEMBLE, BLS = "ensemble", "tensorrt_llm_bls"
MODEL_NAMES = (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, ENSEMBLE, BLS)
ROLE_PARAMETER = "kiln_model"  # config.pbtxt parameter: which of the models a model.py serves

# Client input -> preprocessing's input (TensorRT-LLM's preprocessing/config.pbtxt names).
PREPROCESSED: Mapping[str, str] = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
                                   "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
                                   "end_id": "END_ID", "pad_id": "PAD_ID"}
# Client input -> tensorrt_llm's input where TensorRT-LLM names it otherwise; the others keep their names.
TRTLLM_NAMES: Mapping[str, str] = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "stream": "streaming"}
NOT_FOR_THE_ENGINE = ("output_ids", "sequence_length")  # the single model's outputs the layout decodes instead

PREPROCESSING_INPUTS = (
    TensorSpec("QUERY", "BYTES", (1,), optional=False),
    TensorSpec("REQUEST_OUTPUT_LEN", "INT32", (1,), optional=False),
    TensorSpec("BAD_WORDS_DICT", "BYTES", (-1,)),
    TensorSpec("STOP_WORDS_DICT", "BYTES", (-1,)),
    TensorSpec("END_ID", "INT32", (1,)),
    TensorSpec("PAD_ID", "INT32", (1,)),
)
PREPROCESSING_OUTPUTS = (
    TensorSpec("INPUT_ID", "INT32", (-1,)),
    TensorSpec("REQUEST_INPUT_LEN", "INT32", (1,)),
    TensorSpec("BAD_WORDS_IDS", "INT32", (2, -1)),
    TensorSpec("STOP_WORDS_IDS", "INT32", (2, -1)),
    TensorSpec("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
    TensorSpec("OUT_END_ID", "INT32", (1,), description="-1: the model's own end tokens"),
    TensorSpec("OUT_PAD_ID", "INT32", (1,), description="-1: none given"),
)
# tensorrt_llm's token inputs (the rest are the client inputs of TRTLLM_INPUTS below).
TOKEN_INPUTS = (
    TensorSpec("input_ids", "INT32", (-1,), optional=False),
    TensorSpec("input_lengths", "INT32", (1,), optional=False),
    TensorSpec("request_output_len", "INT32", (1,), optional=False),
    TensorSpec("stop_words_list", "INT32", (2, -1), description="[2, len]: ids, then each word's end offset"),
    TensorSpec("bad_words_list", "INT32", (2, -1), description="[2, len]: ids, then each word's end offset"),
    TensorSpec("end_id", "INT32", (1,), description="< 0: the model's own end tokens"),
    TensorSpec("pad_id", "INT32", (1,)),
)
TRTLLM_OUTPUTS = (
    TensorSpec("output_ids", "INT32", (-1, -1), description="[batch, beam, len]"),
    TensorSpec("sequence_length", "INT32", (-1,), description="[batch, beam]"),
    TensorSpec("cum_log_probs", "FP32", (-1,), description="[batch, beam]"),
    TensorSpec("output_log_probs", "FP32", (-1, -1), description="[batch, beam, len]"),
)
POSTPROCESSING_INPUTS = (TensorSpec("TOKENS_BATCH", "INT32", (-1, -1), optional=False),
                         TensorSpec("SEQUENCE_LENGTH", "INT32", (-1,), optional=False))
POSTPROCESSING_OUTPUTS = (TensorSpec("OUTPUT", "BYTES", (-1,)),)

# (from model, its output) -> (to model, its input); the ensemble's internal tensors are named "_" + output.
STEP_WIRING: tuple[tuple[str, str, str, str], ...] = (
    (PREPROCESSING, "INPUT_ID", TENSORRT_LLM, "input_ids"),
    (PREPROCESSING, "REQUEST_INPUT_LEN", TENSORRT_LLM, "input_lengths"),
    (PREPROCESSING, "REQUEST_OUTPUT_LEN", TENSORRT_LLM, "request_output_len"),
    (PREPROCESSING, "BAD_WORDS_IDS", TENSORRT_LLM, "bad_words_list"),
    (PREPROCESSING, "STOP_WORDS_IDS", TENSORRT_LLM, "stop_words_list"),
    (PREPROCESSING, "OUT_END_ID", TENSORRT_LLM, "end_id"),
    (PREPROCESSING, "OUT_PAD_ID", TENSORRT_LLM, "pad_id"),
    (TENSORRT_LLM, "output_ids", POSTPROCESSING, "TOKENS_BATCH"),
    (TENSORRT_LLM, "sequence_length", POSTPROCESSING, "SEQUENCE_LENGTH"),
)
# The client outputs of ensemble and tensorrt_llm_bls: text from postprocessing, the rest from tensorrt_llm.
TEXT_OUTPUT = ("text_output", POSTPROCESSING, "OUTPUT")
PASSED_OUTPUTS = ("cum_log_probs", "output_log_probs")


@dataclass(frozen=True)
class Route:
    """Where one client input of ensemble / tensorrt_llm_bls goes: `model`'s input `target`."""

    spec: TensorSpec  # the client input (as the single model takes it)
    model: str
    target: str


def routes() -> tuple[Route, ...]:
    """Every client input, in schema.INPUTS' order, with its model and name there. Token-level inputs of the
    single model that preprocessing makes here (stop_words_list, ...) are not client inputs of the layout."""
    made_here = {spec.name for spec in TOKEN_INPUTS}
    return tuple(Route(spec, PREPROCESSING, PREPROCESSED[spec.name]) if spec.name in PREPROCESSED
                 else Route(spec, TENSORRT_LLM, TRTLLM_NAMES.get(spec.name, spec.name))
                 for spec in INPUTS if spec.name in PREPROCESSED or spec.name not in made_here)


def trtllm_inputs() -> tuple[TensorSpec, ...]:
    """tensorrt_llm's inputs: the token inputs, then every client input routed to it, under its name there."""
    routed = tuple(TensorSpec(r.target, r.spec.datatype, r.spec.dims, True, r.spec.description)
                   for r in routes() if r.model == TENSORRT_LLM)
    return TOKEN_INPUTS + routed


def client_outputs() -> tuple[TensorSpec, ...]:
    by_name = {spec.name: spec for spec in TRTLLM_OUTPUTS}
    return (TensorSpec("text_output", "BYTES", (-1,), description="[batch, beam]"),
            *(by_name[name] for name in PASSED_OUTPUTS))


def single_name(trtllm_name: str) -> str:
    """tensorrt_llm's name of a client input -> the single model's (schema.INPUTS) name."""
    return {v: k for k, v in TRTLLM_NAMES.items()}.get(trtllm_name, trtllm_name)


def model_tensors(model: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of one model of the layout."""
    if model == PREPROCESSING:
        return PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS
    if model == TENSORRT_LLM:
        return trtllm_inputs(), TRTLLM_OUTPUTS
    if model == POSTPROCESSING:
        return POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS
    if model in (ENSEMBLE, BLS):
        return tuple(r.spec for r in routes()), client_outputs()
    raise ValueError(f"unknown model {model!r} of the ensemble layout; its models are {', '.join(MODEL_NAMES)}")


def layout_config(model: str, max_batch_size: int, parameters: Mapping[str, str] | None = None):
    """One model's Triton ModelConfig: python backend (ensemble: Triton's ensemble scheduling over STEP_WIRING);
    tensorrt_llm and tensorrt_llm_bls decoupled, as TensorRT-LLM's with decoupled_mode true."""
    from tritonclient.grpc import model_config_pb2 as mc

    inputs, outputs = model_tensors(model)
    config = mc.ModelConfig(name=model, max_batch_size=max_batch_size)
    if model == ENSEMBLE:
        config.platform = "ensemble"
        _add_steps(config, mc)
    else:
        config.backend = "python"
        config.model_transaction_policy.decoupled = model in (TENSORRT_LLM, BLS)
    for spec in inputs:
        config.input.append(mc.ModelInput(name=spec.name, data_type=_dtype(mc, spec), dims=list(spec.dims),
                                          optional=spec.optional))
    for spec in outputs:
        config.output.append(mc.ModelOutput(name=spec.name, data_type=_dtype(mc, spec), dims=list(spec.dims)))
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    return config


def _dtype(mc, spec: TensorSpec) -> int:
    return mc.DataType.Value(DATATYPES[spec.datatype][0])


def _add_steps(config, mc) -> None:
    """preprocessing -> tensorrt_llm -> postprocessing: client inputs by routes(), internal tensors by STEP_WIRING,
    client outputs from tensorrt_llm (PASSED_OUTPUTS) and postprocessing (TEXT_OUTPUT)."""
    steps = {name: mc.ModelEnsembling.Step(model_name=name, model_version=-1)
             for name in (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING)}
    for route in routes():
        steps[route.model].input_map[route.target] = route.spec.name
    for source, output, target, name in STEP_WIRING:
        steps[source].output_map[output] = "_" + output
        steps[target].input_map[name] = "_" + output
    for name in PASSED_OUTPUTS:
        steps[TENSORRT_LLM].output_map[name] = name
    client, model, output = TEXT_OUTPUT
    steps[model].output_map[output] = client
    config.ensemble_scheduling.step.extend(steps.values())

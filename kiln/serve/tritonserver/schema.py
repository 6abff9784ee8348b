"""The tensors of kiln's Triton model: names, types and shapes, as metadata and as a Triton ModelConfig.

Names follow TensorRT-LLM's Triton ensemble, so clients written for it work unchanged. Every tensor has a
leading batch dimension (the model's max_batch_size > 0): a request is one row, `[1, 1]` for scalars and
`[1, N]` for word lists. One table here feeds the HTTP and gRPC metadata and config endpoints and the
`config.pbtxt` that `kiln triton-repo` writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

# KServe v2 datatype -> (Triton config data_type, numpy dtype)
DATATYPES: dict[str, tuple[str, object]] = {
    "BOOL": ("TYPE_BOOL", np.bool_),
    "INT32": ("TYPE_INT32", np.int32),
    "INT64": ("TYPE_INT64", np.int64),
    "UINT64": ("TYPE_UINT64", np.uint64),
    "FP16": ("TYPE_FP16", np.float16),
    "FP32": ("TYPE_FP32", np.float32),
    "BYTES": ("TYPE_STRING", np.object_),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor; `dims` excludes the batch dimension (-1 = any length)."""

    name: str
    datatype: str  # KServe v2 name: BOOL, INT32, UINT64, FP16, FP32, BYTES, ...
    dims: tuple[int, ...]
    optional: bool = True
    description: str = ""


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES", (1,), optional=False, description="the prompt (UTF-8)"),
    TensorSpec("max_tokens", "INT32", (1,), optional=False, description="most tokens to generate"),
    TensorSpec("temperature", "FP32", (1,), description="0 = greedy; default 0, or 1 when top_k/top_p is set"),
    TensorSpec("top_k", "INT32", (1,), description="0 = off"),
    TensorSpec("top_p", "FP32", (1,), description="nucleus mass in (0, 1]; 0 = off, as in TensorRT-LLM"),
    TensorSpec("min_p", "FP32", (1,)),
    TensorSpec("repetition_penalty", "FP32", (1,)),
    TensorSpec("presence_penalty", "FP32", (1,)),
    TensorSpec("frequency_penalty", "FP32", (1,)),
    TensorSpec("seed", "UINT64", (1,), description="random seed (TensorRT-LLM's random_seed is accepted too)"),
    TensorSpec("random_seed", "UINT64", (1,), description="TensorRT-LLM's name for seed"),
    TensorSpec("stop_words", "BYTES", (-1,), description="strings that end generation (empty ones ignored)"),
    TensorSpec("bad_words", "BYTES", (-1,), description="strings never generated, matched on text (empty ones "
                                                        "ignored; see docs/features.md, Bad words)"),
    TensorSpec("bad_words_list", "INT32", (2, -1),
               description="token-id sequences never generated, TensorRT-LLM's layout: row 0 the ids one after "
                           "another, row 1 each sequence's end offset (padded with -1)"),
    TensorSpec("stop_words_list", "INT32", (2, -1),
               description="token-id sequences that end generation, in bad_words_list's layout (one id: a stop "
                           "token; several: the stop string of their text)"),
    TensorSpec("embedding_bias", "FP32", (-1,),
               description="[vocab] added to the logits before sampling (empty: none)"),
    TensorSpec("end_id", "INT32", (1,), description="token id that ends generation instead of the model's EOS"),
    TensorSpec("pad_id", "INT32", (1,), description="pads output_ids after a beam's sequence_length"),
    TensorSpec("beam_width", "INT32", (1,),
               description="beams of a beam search (1 = none); up to the engine's max_beam_width (kiln build "
                           "--max-beam-width); each output then has a beam dimension"),
    TensorSpec("num_return_sequences", "INT32", (1,),
               description="with beam_width > 1: how many of the best beams to return (default: all); 1 otherwise"),
    TensorSpec("len_penalty", "FP32", (1,),
               description="beam search: a finished beam's score is its cum_log_probs / length ** len_penalty"),
    TensorSpec("length_penalty", "FP32", (1,), description="the ensemble's name for len_penalty"),
    TensorSpec("early_stopping", "BOOL", (1,),
               description="beam search: stop once beam_width beams have finished (default false: stop when no "
                           "running beam can beat them, as Hugging Face's)"),
    TensorSpec("stream", "BOOL", (1,), description="stream text pieces (gRPC stream, generate_stream)"),
    TensorSpec("return_log_probs", "BOOL", (1,), description="fill output_log_probs and cum_log_probs"),
    TensorSpec("return_context_logits", "BOOL", (1,),
               description="fill context_logits: the raw logits of every prompt position (skips the prefix cache)"),
    TensorSpec("return_generation_logits", "BOOL", (1,),
               description="fill generation_logits: the raw logits each generated token was chosen from"),
    TensorSpec("return_perf_metrics", "BOOL", (1,),
               description="fill the kv_cache_* blocks, *_time_ns and draft-token outputs"),
    TensorSpec("exclude_input_in_output", "BOOL", (1,),
               description="text_output without the prompt (streamed pieces never repeat it)"),
    TensorSpec("guided_decoding_guide_type", "BYTES", (1,),
               description="structured output, as TensorRT-LLM names it: json (any JSON object), json_schema, "
                           "regex or ebnf_grammar"),
    TensorSpec("guided_decoding_guide", "BYTES", (1,),
               description="the JSON schema, regex or EBNF grammar (xgrammar's dialect) the output follows"),
    # LoRA as TensorRT-LLM's Triton backend takes it (serve/tritonserver/lora_tasks.py, checkpoints/trtllm_lora.py)
    TensorSpec("lora_task_id", "UINT64", (1,),
               description="the LoRA adapter to run with; the first request of an id also sends lora_weights and "
                           "lora_config, later ones the id alone (needs --enable-lora)"),
    TensorSpec("lora_weights", "FP16", (-1, -1),
               description="per adapted module and layer: its in-weight [r, in] then out-weight [out, r] (scaling "
                           "folded in), flattened and zero-padded to the longest row (TensorRT-LLM's "
                           "hf_lora_convert.py)"),
    TensorSpec("lora_config", "INT32", (-1, 3),
               description="a row per row of lora_weights: [module_id, layer_idx, adapter_size]; module ids: "
                           "attn_qkv 0, attn_q 1, attn_k 2, attn_v 3, attn_dense 4, mlp_h_to_4h 5 (gate_proj), "
                           "mlp_4h_to_h 6 (down_proj), mlp_gate 7 (up_proj)"),
)
# Outputs are per beam, as TensorRT-LLM's: [batch, beam(, len)]; beam is 1 without beam search.
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,), description="[batch, beam]: each beam's text"),
    TensorSpec("output_log_probs", "FP32", (-1, -1),
               description="[batch, beam, len]: the generated tokens' logprobs, padded with 0"),
    TensorSpec("cum_log_probs", "FP32", (-1,), description="[batch, beam]: the sum of a beam's logprobs"),
    TensorSpec("output_ids", "INT32", (-1, -1),
               description="[batch, beam, len]: the prompt's (unless exclude_input_in_output) then the generated "
                           "token ids, padded with pad_id (else end_id, else the model's EOS)"),
    TensorSpec("sequence_length", "INT32", (-1,), description="[batch, beam]: the ids of output_ids that count"),
    # return_context_logits / return_generation_logits: raw float32 logits (before penalties, temperature, masks),
    # zero-padded; return_perf_metrics: one value per row (times: nanoseconds since the epoch). TensorRT-LLM's.
    TensorSpec("context_logits", "FP32", (-1, -1), description="[batch, prompt_len, vocab]"),
    TensorSpec("generation_logits", "FP32", (-1, -1, -1), description="[batch, beam, len, vocab]"),
    TensorSpec("kv_cache_alloc_new_blocks", "INT32", (1,), description="KV blocks the request filled"),
    TensorSpec("kv_cache_reused_blocks", "INT32", (1,), description="KV blocks it took from the prefix cache"),
    TensorSpec("kv_cache_alloc_total_blocks", "INT32", (1,), description="KV blocks it held in all"),
    TensorSpec("arrival_time_ns", "INT64", (1,), description="when the engine received it"),
    TensorSpec("first_scheduled_time_ns", "INT64", (1,), description="when it was first scheduled"),
    TensorSpec("first_token_time_ns", "INT64", (1,), description="when its first token was generated"),
    TensorSpec("last_token_time_ns", "INT64", (1,), description="when its last token was generated"),
    TensorSpec("acceptance_rate", "FP32", (1,), description="speculative decoding: accepted / drafted tokens"),
    TensorSpec("total_accepted_draft_tokens", "INT32", (1,), description="speculative decoding: drafts kept"),
    TensorSpec("total_draft_tokens", "INT32", (1,), description="speculative decoding: drafts proposed"),
)
INPUT_SPECS: Mapping[str, TensorSpec] = {t.name: t for t in INPUTS}
OUTPUT_SPECS: Mapping[str, TensorSpec] = {t.name: t for t in OUTPUTS}
MODEL_VERSION = "1"


def model_metadata(model_name: str, platform: str = "kiln") -> dict:
    """KServe v2 model metadata (`GET /v2/models/{name}`); shapes include the batch dimension (-1)."""
    def tensors(specs):
        return [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]} for t in specs]
    return {"name": model_name, "versions": [MODEL_VERSION], "platform": platform,
            "inputs": tensors(INPUTS), "outputs": tensors(OUTPUTS)}


def model_config(model_name: str, max_batch_size: int, *, backend: str = "kiln",
                 parameters: Mapping[str, str] | None = None):
    """The model's Triton `ModelConfig` protobuf (decoupled: one request may stream many responses)."""
    from tritonclient.grpc import model_config_pb2 as mc

    config = mc.ModelConfig(name=model_name, backend=backend, max_batch_size=max_batch_size)
    config.model_transaction_policy.decoupled = True
    for spec in INPUTS:
        config.input.append(mc.ModelInput(name=spec.name, data_type=mc.DataType.Value(DATATYPES[spec.datatype][0]),
                                          dims=list(spec.dims), optional=spec.optional))
    for spec in OUTPUTS:
        config.output.append(mc.ModelOutput(name=spec.name, data_type=mc.DataType.Value(DATATYPES[spec.datatype][0]),
                                            dims=list(spec.dims)))
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    return config


def model_config_json(config) -> dict:
    """A ModelConfig as Triton's HTTP endpoint returns it (protobuf JSON with the proto field names)."""
    from google.protobuf import json_format

    return json_format.MessageToDict(config, preserving_proto_field_name=True)

"""The ensemble layout's `tensorrt_llm` model (layout.py): the one kiln engine, token ids in and out under
TensorRT-LLM's names (input_ids, input_lengths, request_output_len, ... -> output_ids, sequence_length,
cum_log_probs, output_log_probs), decoupled.

Each row is turned into the single model's inputs (TRTLLM_NAMES renamed back, request_output_len as max_tokens,
the word lists decoded to stop/bad word strings: kiln matches them on text) and parsed by request.parse_request,
so both layouts take the same sampling inputs with the same checks. output_ids hold the prompt's ids (unless
exclude_input_in_output) then the generated ones, [batch, beam, len] padded with pad_id (else 0); streamed
responses (streaming=true, one row) carry only the new ids, or the whole beams with beam_width > 1 (beams are
re-ranked every step); the last response always carries tensors and the final flag, for the ensemble's sake.
"""

from __future__ import annotations

import numpy as np

from kiln.serve.errors import InvalidRequest
from kiln.serve.tritonserver.layout import TOKEN_INPUTS, single_name
from kiln.serve.tritonserver.relay import Relay
from kiln.serve.tritonserver.request import TritonRequest, parse_request
from kiln.serve.tritonserver.text_steps import words_of

_TOKEN_NAMES = {spec.name for spec in TOKEN_INPUTS}


def parse_token_rows(tokenizer, inputs: dict[str, np.ndarray]) -> list[tuple[list[int], TritonRequest]]:
    """tensorrt_llm's inputs ([batch, ...] each) -> (prompt ids, TritonRequest) per row."""
    for name in ("input_ids", "input_lengths", "request_output_len"):
        if name not in inputs:
            raise InvalidRequest(f"missing required input '{name}'", name)
    ids = np.asarray(inputs["input_ids"])
    ids = ids[None] if ids.ndim == 1 else ids
    lengths = np.asarray(inputs["input_lengths"]).reshape(-1)
    if ids.ndim != 2 or len(lengths) != ids.shape[0]:
        raise InvalidRequest(f"input 'input_ids' has shape {list(ids.shape)}; expected [batch, len] with one "
                             f"input_lengths per row ({len(lengths)})", "input_ids")
    rows = []
    for i in range(ids.shape[0]):
        row = {name: np.asarray(array)[i:i + 1] for name, array in inputs.items()}
        length = int(lengths[i])
        if not 0 < length <= ids.shape[1]:
            raise InvalidRequest(f"input 'input_lengths' is {length}; it must be in [1, {ids.shape[1]}] "
                                 "(the row's ids in input_ids)", "input_lengths")
        single = {single_name(name): array for name, array in row.items() if name not in _TOKEN_NAMES}
        single["text_input"] = np.array([[b""]], dtype=np.object_)
        single["max_tokens"] = row["request_output_len"].reshape(1, 1)
        for name in ("end_id", "pad_id"):  # < 0: not given (preprocessing's stand-in for "the model's own")
            if name in row and int(row[name].reshape(-1)[0]) >= 0:
                single[name] = row[name].reshape(1, 1)
        for name, words_name in (("stop_words_list", "stop_words"), ("bad_words_list", "bad_words")):
            words = words_of(tokenizer, row[name].reshape(row[name].shape[-2:]) if name in row else None, name)
            if words:
                single[words_name] = np.array([[w.encode("utf-8") for w in words]], dtype=np.object_)
        (request,) = parse_request(single)
        rows.append((ids[i, :length].astype(int).tolist(), request))
    return rows


def _beams(output, request: TritonRequest) -> list:
    beams = list(output.outputs)
    return beams[:getattr(request, "num_return_sequences", len(beams)) or len(beams)]


def token_arrays(rows: list[tuple[list[int], TritonRequest]], outputs: list, sent: list[int] | None = None
                 ) -> dict[str, np.ndarray]:
    """The four outputs for every row's latest RequestOutput; `sent`: per row, generated ids already streamed
    (only the new ones go out, beam width 1; with beams the whole beams do)."""
    ids_rows, lp_rows, cum_rows = [], [], []
    for i, ((prompt, request), output) in enumerate(zip(rows, outputs)):
        beams = _beams(output, request)
        ids_row, lp_row, cum_row = [], [], []
        for beam in beams:
            tokens, logprobs = list(beam.token_ids), list(beam.logprobs or [])
            if sent is not None and len(beams) == 1:
                tokens, logprobs = tokens[sent[i]:], logprobs[sent[i]:]
            elif sent is None and not request.exclude_input:
                tokens = prompt + tokens
            ids_row.append(tokens)
            lp_row.append(logprobs)
            total = beam.cumulative_logprob if beam.cumulative_logprob is not None else sum(beam.logprobs or [])
            cum_row.append(total)
        ids_rows.append(ids_row)
        lp_rows.append(lp_row)
        cum_rows.append(cum_row)
    pads = [max(getattr(request, "pad_id", None) or 0, 0) for _, request in rows]
    width = max(1, max(len(r) for r in ids_rows))
    length = max((len(t) for r in ids_rows for t in r), default=0)
    out_ids = np.zeros((len(rows), width, length), dtype=np.int32)
    seq_len = np.zeros((len(rows), width), dtype=np.int32)
    lp_len = max((len(t) for r in lp_rows for t in r), default=0)
    out_lp = np.zeros((len(rows), width, lp_len), dtype=np.float32)
    cum = np.zeros((len(rows), width), dtype=np.float32)
    for b, (ids_row, lp_row, cum_row) in enumerate(zip(ids_rows, lp_rows, cum_rows)):
        out_ids[b] = pads[b]
        for k, (tokens, logprobs, total) in enumerate(zip(ids_row, lp_row, cum_row)):
            out_ids[b, k, :len(tokens)] = tokens
            seq_len[b, k] = len(tokens)
            out_lp[b, k, :len(logprobs)] = logprobs
            cum[b, k] = total
    return {"output_ids": out_ids, "sequence_length": seq_len, "cum_log_probs": cum, "output_log_probs": out_lp}


class TokenModel:
    """The model.py side of tensorrt_llm: the engine (an AsyncLLM) and the relay, as the single model holds them."""

    def __init__(self, base) -> None:
        self.base = base  # the loaded kiln_model.py: load_kiln_engine, instance_device, error_response, Relay

    def initialize(self, args: dict, params, config: dict) -> None:
        from kiln.serve.lora_modules import server_loras
        from kiln.serve.tritonserver.lora_tasks import LoRATasks

        base = self.base
        self.llm = base.load_kiln_engine(params, base.instance_device(args, params), config.get("max_batch_size") or None)
        self.relay = Relay(self.llm)
        self.lora_tasks = LoRATasks(self.llm, server_loras(self.llm, args.get("model_name", "tensorrt_llm"), ()),
                                    "write the repository with `kiln triton-repo --enable-lora`")

    def execute(self, requests: list) -> None:
        from kiln.serve.tritonserver.layout import trtllm_inputs

        pb, base = self.base.pb_utils, self.base
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {spec.name: t.as_numpy() for spec in trtllm_inputs()
                          if (t := pb.get_input_tensor_by_name(request, spec.name)) is not None}
                rows = parse_token_rows(self.llm.tokenizer, inputs)
                if len(rows) > 1 and any(r.stream for _, r in rows):
                    raise InvalidRequest("streaming=true takes one prompt per request (batch size 1)", "streaming")
                loras = [self.lora_tasks.resolve(r.lora) for _, r in rows]
                for prompt, r in rows:
                    try:
                        self.llm.check_fits(len(self.llm.tokenize(prompt)), r.params)
                    except ValueError as e:
                        raise InvalidRequest(str(e), "input_ids") from None
                self.relay.submit([p for p, _ in rows], [r.params for _, r in rows], _TokenSink(base, sender, rows),
                                  loras)
            except InvalidRequest as e:
                sender.send(base.error_response(e.message, "INVALID_ARG"), flags=base.FINAL)
            except RuntimeError as e:
                sender.send(base.error_response(str(e), "UNAVAILABLE"), flags=base.FINAL)
        return None

    def finalize(self) -> None:
        self.relay.stop()
        self.llm.shutdown()


class _TokenSink:
    """One request's way back (relay.Sink): a response per update while streaming, else one at the end."""

    def __init__(self, base, sender, rows) -> None:
        self.base, self.sender, self.rows = base, sender, rows
        self.outputs: list = [None] * len(rows)
        self.sent = [0]  # streaming: generated ids sent so far (one row)
        self.stream = rows[0][1].stream
        self.cancelled = getattr(sender, "is_cancelled", lambda: False)  # relay.py stops asking once answered

    def _send(self, arrays: dict, final: bool) -> None:
        pb = self.base.pb_utils
        response = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in arrays.items()])
        self.sender.send(response, flags=self.base.FINAL if final else 0)

    def update(self, row: int, output) -> None:
        self.outputs[row] = output
        if self.stream:
            arrays = token_arrays(self.rows, [output], self.sent)
            if arrays["sequence_length"].any() or output.finished:
                self._send(arrays, output.finished)
            self.sent[0] = len(output.token_ids)
        elif all(o is not None and o.finished for o in self.outputs):
            self._send(token_arrays(self.rows, self.outputs), True)

    def reject(self, message: str) -> None:
        self.sender.send(self.base.error_response(message, "INVALID_ARG"), flags=self.base.FINAL)

    def abort(self, message: str | None) -> None:
        if message is None:
            self.sender.send(flags=self.base.FINAL)
        else:
            self.sender.send(self.base.error_response(message, "UNAVAILABLE"), flags=self.base.FINAL)

    def fail(self, message: str, client_error: bool) -> None:
        code = "INVALID_ARG" if client_error else "INTERNAL"
        self.sender.send(self.base.error_response(message, code), flags=self.base.FINAL)

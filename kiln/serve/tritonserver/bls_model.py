"""The ensemble layout's `tensorrt_llm_bls` model (layout.py): TensorRT-LLM's BLS model, calling preprocessing,
tensorrt_llm and postprocessing through Triton's BLS API with the tensors routes() and STEP_WIRING name (the
ensemble's own tables), decoupled.

Each request runs on a thread of its own, so requests batch in the engine (TensorRT-LLM's BLS runs one request
at a time per instance). Streamed text is decoded from all the ids so far (TensorRT-LLM's accumulate_tokens,
always on): each response carries the new text only, never half a character, and a word's leading space
survives, where the ensemble decodes each streamed piece alone.
"""

from __future__ import annotations

import threading

import numpy as np

from kiln.serve.tritonserver.layout import (
    PASSED_OUTPUTS,
    POSTPROCESSING,
    PREPROCESSING,
    STEP_WIRING,
    TENSORRT_LLM,
    routes,
)


class _StepFailed(Exception):
    def __init__(self, error) -> None:
        super().__init__(error.message())
        self.error = error


class BlsModel:
    def __init__(self, base) -> None:
        self.base = base  # the loaded kiln_model.py: pb_utils, error_response, FINAL

    def initialize(self, args: dict, params, config: dict) -> None:
        pass

    def execute(self, requests: list) -> None:
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name="kiln-bls", daemon=True).start()
        return None

    def finalize(self) -> None:
        pass

    def _call(self, model: str, arrays: dict, outputs: list[str], decoupled: bool = False):
        pb = self.base.pb_utils
        request = pb.InferenceRequest(model_name=model, requested_output_names=outputs,
                                      inputs=[pb.Tensor(k, v) for k, v in arrays.items()])
        return request.exec(decoupled=True) if decoupled else request.exec()

    def _outputs(self, response) -> dict:
        if response.has_error():
            raise _StepFailed(response.error())
        return {t.name(): t.as_numpy() for t in response.output_tensors()}

    def _serve(self, request) -> None:
        pb, base = self.base.pb_utils, self.base
        sender = request.get_response_sender()
        try:
            given = {r.spec.name: t.as_numpy() for r in routes()
                     if (t := pb.get_input_tensor_by_name(request, r.spec.name)) is not None}
            step_inputs: dict[str, dict] = {PREPROCESSING: {}, TENSORRT_LLM: {}, POSTPROCESSING: {}}
            for route in routes():
                if route.spec.name in given:
                    step_inputs[route.model][route.target] = given[route.spec.name]
            wiring = [w for w in STEP_WIRING if w[0] == PREPROCESSING]
            pre = self._outputs(self._call(PREPROCESSING, step_inputs[PREPROCESSING], [w[1] for w in wiring]))
            for _, output, _, name in wiring:
                step_inputs[TENSORRT_LLM][name] = pre[output]
            stream = bool(np.asarray(given.get("stream", [[False]])).reshape(-1)[0])
            wanted = [w[1] for w in STEP_WIRING if w[0] == TENSORRT_LLM] + list(PASSED_OUTPUTS)
            accumulated: np.ndarray | None = None
            said, whole, last = "", "", None
            # A decoupled BLS call's iterator ends after the final response; the final flag itself is not shown.
            for response in self._call(TENSORRT_LLM, step_inputs[TENSORRT_LLM], wanted, decoupled=True):
                if not response.has_error() and not response.output_tensors():
                    continue
                out = self._outputs(response)
                ids, lengths = out["output_ids"], out["sequence_length"]
                if stream and ids.shape[1] == 1:  # new ids only: decode all so far, send the new text
                    new = ids[:, :, :int(lengths.reshape(-1)[0])]
                    accumulated = new if accumulated is None else np.concatenate([accumulated, new], axis=2)
                    ids, lengths = accumulated, np.array([[accumulated.shape[2]]], dtype=np.int32)
                text = self._outputs(self._call(POSTPROCESSING, {"TOKENS_BATCH": ids, "SEQUENCE_LENGTH": lengths},
                                                ["OUTPUT"]))["OUTPUT"]
                arrays = {"text_output": text, **{name: out[name] for name in PASSED_OUTPUTS if name in out}}
                if not stream:
                    last = arrays
                    continue
                if text.shape[1] == 1:
                    whole = _text(text[0, 0])
                    if whole.endswith("\ufffd"):  # half a character: wait for its other bytes (or the end)
                        continue
                    arrays["text_output"] = np.array([[whole[len(said):].encode("utf-8")]], dtype=np.object_)
                    said = whole
                sender.send(_response(pb, arrays))
            if stream and whole[len(said):]:  # what was held back for a character the stream never finished
                sender.send(_response(pb, {"text_output": np.array([[whole[len(said):].encode("utf-8")]],
                                                                   dtype=np.object_)}))
            if last is not None:
                sender.send(_response(pb, last), flags=base.FINAL)
            else:
                sender.send(flags=base.FINAL)
        except _StepFailed as e:
            sender.send(pb.InferenceResponse(output_tensors=[], error=e.error), flags=base.FINAL)
        except Exception as e:  # the client must hear of it: Triton waits for the final flag
            sender.send(base.error_response(f"tensorrt_llm_bls: {e!r}", "INTERNAL"), flags=base.FINAL)


def _response(pb, arrays: dict):
    return pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in arrays.items()])


def _text(value) -> str:
    return value if isinstance(value, str) else bytes(value).decode("utf-8")

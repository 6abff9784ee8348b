"""A test stand-in for the part of Triton's `triton_python_backend_utils` that kiln's model.py uses.

The real module exists only inside the Triton Python backend's stub process, and no Triton server can run
in our CI, so this one is written from the Python backend's documentation
(github.com/triton-inference-server/python_backend, README: "Usage", "Error Handling", "Decoupled mode",
"Request Cancellation Handling"). It enforces the rules that documentation states for decoupled models:
responses go through the request's response sender, the last one carries
TRITONSERVER_RESPONSE_COMPLETE_FINAL, nothing may be sent after it (the sender raises), a send without a
response must carry the final flag, and a cancelled request still needs its final flag. Input tensors are
released once `execute` returns (`InferenceRequest.release`), since Triton frees them then.

Beyond the real API, tests use `InferenceRequest(inputs, requested_output_names)`, `ResponseSender.cancel()`,
`ResponseSender.wait_final()` and the sender's record of what was sent (`responses`, `sends`).
"""

from __future__ import annotations

import threading
import time

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, numpy_array: np.ndarray) -> None:
        if not isinstance(numpy_array, np.ndarray):
            raise TritonModelException(f"Tensor {name!r}: expected a numpy array, got {type(numpy_array).__name__}")
        if numpy_array.dtype.type == np.str_ or numpy_array.dtype == np.void:
            # The documented rule: strings travel as np.object_ arrays (of bytes).
            raise TritonModelException("Tensor dtype used for numpy_array is not supported by Python backend. "
                                       "Please use np.object_ instead.")
        self._name = name
        self._array = numpy_array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        if output_tensors is not None and not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        self._tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """Records what a decoupled model sends for one request; safe to use from any thread."""

    def __init__(self) -> None:
        self.sends: list[tuple[float, InferenceResponse | None, int]] = []  # (time.monotonic(), response, flags)
        self._cancelled = False
        self._final = threading.Event()
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            if self._final.is_set():
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
                raise TritonModelException(f"unknown response flags {flags}")
            if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                raise TritonModelException("a send without a response must carry the final flag")
            if response is not None and not isinstance(response, InferenceResponse):
                raise TritonModelException(f"expected an InferenceResponse, got {type(response).__name__}")
            self.sends.append((time.monotonic(), response, flags))
            if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._final.set()

    def is_cancelled(self) -> bool:
        return self._cancelled

    # ---- test helpers --------------------------------------------------------------------------
    def cancel(self) -> None:
        """What Triton does when the client goes away."""
        self._cancelled = True

    def wait_final(self, timeout: float = 30.0) -> bool:
        return self._final.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._final.is_set()

    @property
    def responses(self) -> list[InferenceResponse]:
        return [response for _, response, _ in self.sends if response is not None]


class InferenceRequest:
    def __init__(self, inputs: list[Tensor], requested_output_names: list[str] | tuple = (),
                 request_id: str = "") -> None:
        self._inputs: list[Tensor] | None = list(inputs)
        self._requested_output_names = list(requested_output_names)
        self._request_id = request_id
        self.sender = ResponseSender()

    def inputs(self) -> list[Tensor]:
        if self._inputs is None:
            raise TritonModelException("the request's input tensors were released when execute returned")
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def requested_output_names(self) -> list[str]:
        return list(self._requested_output_names)

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def release(self) -> None:
        """Triton frees a request's input tensors once execute returns."""
        self._inputs = None


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))

"""Triton's gRPC service `inference.GRPCInferenceService`, on the stubs that tritonclient ships.

ModelInfer runs each batch row as its own engine request and answers once with the whole text.
ModelStreamInfer is decoupled, as Triton serves TensorRT-LLM: the requests on one stream run concurrently,
each answered by one response per text piece (input `stream` true) or by one response, every response
marked with the parameter `triton_final_response`. A client that goes away cancels its RPC, which aborts
its engine requests and frees their KV blocks. With an API key, every RPC but ServerLive and ServerReady
needs the metadata `authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

import kiln
from kiln.serve.config import ServeConfig
from kiln.serve.engine_service import EngineService
from kiln.serve.errors import InvalidRequest, NotFound, RequestError
from kiln.serve.guided_request import TRITON_GUIDE_LABEL
from kiln.serve.http.common import check_api_key
from kiln.serve.limits import RequestLimits
from kiln.serve.tritonserver.batch import cancel_and_wait, complete_all, with_loras
from kiln.serve.tritonserver.beam_rows import beams_of, check_beam_widths
from kiln.serve.tritonserver.logits_outputs import streamed
from kiln.serve.tritonserver.request import (
    Beam,
    TritonRequest,
    check_datatype,
    check_prompt_sizes,
    check_requested_outputs,
    make_outputs,
    numpy_dtype,
    pad_ids,
    parse_request,
)
from kiln.serve.tritonserver.schema import MODEL_VERSION, OUTPUT_SPECS, model_config, model_metadata
from kiln.serve.tritonserver.wire import decode_raw, encode_raw, reshape

logger = logging.getLogger("kiln.serve")

EXTENSIONS = ("model_configuration", "parameters")
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
# The `InferTensorContents` field that holds each datatype (when raw_input_contents is not used).
_CONTENTS = {"BOOL": "bool_contents", "INT32": "int_contents", "INT64": "int64_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "BYTES": "bytes_contents"}
_UNIMPLEMENTED = ("ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
                  "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                  "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
                  "TraceSetting", "LogSettings")


# ---- tensors ------------------------------------------------------------------------------------------
def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """The input tensors as numpy arrays of their declared shapes (BYTES: object arrays of bytes)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents; "
                             "give raw contents for every input or for none")
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        check_datatype(name, tensor.datatype)
        if name in arrays:
            raise InvalidRequest(f"input '{name}' is given twice", name)
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            raise InvalidRequest(f"input '{name}' has shape {list(shape)}; dimensions must be >= 0", name)
        if raw:
            arrays[name] = decode_raw(name, tensor.datatype, raw[i], shape, where="raw_input_contents")
        else:
            arrays[name] = _from_contents(tensor, shape)
    return arrays


def _from_contents(tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...]) -> np.ndarray:
    field = _CONTENTS.get(tensor.datatype)
    if field is None:  # KServe's InferTensorContents has no field for 16-bit floats
        raise InvalidRequest(f"input '{tensor.name}' is {tensor.datatype}: send it in raw_input_contents (as "
                             "tritonclient does)", tensor.name)
    values = np.array(list(getattr(tensor.contents, field)), dtype=numpy_dtype(tensor.datatype))
    return reshape(tensor.name, values, shape, f"contents.{field}")


def encode_outputs(outputs: Mapping[str, np.ndarray], response: pb.ModelInferResponse) -> None:
    """Appends the outputs to `response` as tensors with raw contents (as Triton answers tritonclient)."""
    for name, array in outputs.items():
        datatype = OUTPUT_SPECS[name].datatype
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(encode_raw(datatype, array))


# ---- the service --------------------------------------------------------------------------------------
def _check_api_key(config: ServeConfig, context: grpc.aio.ServicerContext) -> None:
    """Raises Unauthorized unless the metadata has `authorization: Bearer <key>` (gRPC keys are lowercase)."""
    check_api_key(config, dict(context.invocation_metadata() or ()).get("authorization"))


def _rpc(method):
    """Checks the API key; a RequestError becomes its gRPC status (the server keeps serving)."""
    @functools.wraps(method)
    async def checked(self: KServeServicer, request, context: grpc.aio.ServicerContext):
        try:
            _check_api_key(self.config, context)
            return await method(self, request, context)
        except RequestError as e:
            await context.abort(grpc.StatusCode[e.grpc_code], e.message)
    return checked


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """One model (`service.model_name`, version 1); the RPCs of Triton's gRPC protocol that apply to it."""

    def __init__(self, service: EngineService, config: ServeConfig) -> None:
        self.service = service
        self.config = config

    def _check_model(self, name: str, version: str) -> None:
        if name != self.service.model_name:
            raise NotFound(f"unknown model '{name}'; this server serves '{self.service.model_name}'")
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"model '{name}' has no version '{version}'; its only version is {MODEL_VERSION}")

    # Probes (load balancers, Kubernetes) cannot send a key; these say nothing about the model.
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.service.ready)

    @_rpc
    async def ModelReady(self, request, context):
        self._check_model(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.service.ready)

    @_rpc
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="kiln", version=kiln.__version__, extensions=EXTENSIONS)

    @_rpc
    async def ModelMetadata(self, request, context):
        self._check_model(request.name, request.version)
        meta = model_metadata(self.service.model_name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=[tensor(**t) for t in meta["inputs"]],
                                        outputs=[tensor(**t) for t in meta["outputs"]])

    @_rpc
    async def ModelConfig(self, request, context):
        self._check_model(request.name, request.version)
        return pb.ModelConfigResponse(config=model_config(self.service.model_name, self.service.max_batch_size))

    @_rpc
    async def ModelInfer(self, request, context):
        rows, names = self._parse(request)
        async with with_loras(self.service, rows) as rows:
            return self._response(request, await self._infer(rows, names))

    async def ModelStreamInfer(self, request_iterator, context):
        """Starts each request as it arrives; responses go out as they are made, in any order (their `id`
        says whose). A failed request answers with `error_message` and the stream goes on."""
        try:
            _check_api_key(self.config, context)
        except RequestError as e:
            await context.abort(grpc.StatusCode[e.grpc_code], e.message)
        responses: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        reader = asyncio.ensure_future(self._serve_stream(request_iterator, responses.put_nowait))
        try:
            while (response := await responses.get()) is not None:
                yield response
            await reader  # raises what ended the stream, if anything did
        finally:  # the client went away (or the server stops): abort what still runs
            await cancel_and_wait([reader])

    # ---- inference --------------------------------------------------------------------------------
    def _parse(self, request: pb.ModelInferRequest) -> tuple[list[TritonRequest], list[str]]:
        self._check_model(request.model_name, request.model_version)
        limits = RequestLimits.from_config(self.config)
        rows = parse_request(decode_inputs(request), limits)
        check_prompt_sizes(rows, limits.prompt_chars_limit(self.service.max_seq_len))
        if len(rows) > self.service.max_batch_size:
            raise InvalidRequest(f"batch size {len(rows)} is more than the model's max_batch_size "
                                 f"{self.service.max_batch_size}", "text_input")
        return rows, check_requested_outputs([o.name for o in request.outputs], rows)

    def _response(self, request: pb.ModelInferRequest, outputs: Mapping[str, np.ndarray],
                  final: bool | None = None) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(model_name=self.service.model_name, model_version=MODEL_VERSION,
                                         id=request.id)
        encode_outputs(outputs, response)
        if final is not None:
            response.parameters[FINAL].bool_param = final
        return response

    async def _infer(self, rows: list[TritonRequest], names: Sequence[str]) -> dict[str, np.ndarray]:
        """Every row to completion, concurrently: text_output is the prompt and the generated text."""
        results = await complete_all(self.service, rows, RequestLimits.from_config(self.config))
        return make_outputs(names, results, pad_ids(rows, self.service.llm.eos_token_ids))

    async def _serve_stream(self, request_iterator, emit: Callable[[pb.ModelStreamInferResponse | None], None]):
        """Runs each incoming request in a task of its own; after the client's last request and their
        responses, emits None."""
        tasks: set[asyncio.Task] = set()
        try:
            async for request in request_iterator:
                task = asyncio.ensure_future(self._stream_request(request, emit))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks)
        finally:
            await cancel_and_wait(list(tasks))
            emit(None)

    async def _stream_request(self, request: pb.ModelInferRequest,
                              emit: Callable[[pb.ModelStreamInferResponse], None]) -> None:
        empty_final = EMPTY_FINAL in request.parameters and request.parameters[EMPTY_FINAL].bool_param
        try:
            rows, names = self._parse(request)
            if any(row.stream for row in rows) and len(rows) != 1:
                raise InvalidRequest(f"input 'stream' is true with batch size {len(rows)}; streaming takes "
                                     "one request (batch size 1) at a time", "stream")
            async with with_loras(self.service, rows) as rows:
                if rows[0].stream:
                    check_beam_widths(self.service.llm, rows)
                    await self._stream_text(request, rows[0], names, emit, last_is_final=not empty_final)
                else:
                    outputs = await self._infer(rows, names)
                    emit(pb.ModelStreamInferResponse(infer_response=self._response(request, outputs,
                                                                                   not empty_final)))
            if empty_final:
                emit(pb.ModelStreamInferResponse(infer_response=self._response(request, {}, True)))
        except Exception as e:  # this request fails; the stream keeps serving the others
            if not isinstance(e, RequestError):
                logger.exception("gRPC stream request %r failed", request.id)
            message = e.message if isinstance(e, RequestError) else f"internal error: {e!r}"
            emit(pb.ModelStreamInferResponse(error_message=message, infer_response=self._response(request, {}, True)))

    async def _stream_text(self, request: pb.ModelInferRequest, row: TritonRequest, names: Sequence[str],
                           emit: Callable[[pb.ModelStreamInferResponse], None], last_is_final: bool) -> None:
        """One response per new piece of text (never the prompt): output_log_probs holds the piece's tokens,
        cum_log_probs the sum over all tokens so far. With beam search (which TensorRT-LLM cannot stream), one
        response per update holding the current beams whole: their generated text, ids and logprobs."""
        stream = self.service.generate(row.prompt, row.params, cut_off_is_error=True, guided_field=TRITON_GUIDE_LABEL,
                                       lora_request=row.lora_request)
        cum_log_prob = 0.0  # over every token so far, shown or not
        new_ids: list[int] = []
        first = True  # the first response carries the context logits (when asked)
        async with contextlib.aclosing(stream) as stream:
            async for delta in stream:
                cum_log_prob += sum(delta.logprobs)
                new_ids += delta.token_ids  # output_ids: the tokens since the last response
                pad = pad_ids([row], self.service.llm.eos_token_ids)
                if delta.beams is not None:
                    outputs = make_outputs(names, [beams_of(row, delta.output, whole=False)], pad)
                elif not (delta.text or delta.finished or (row.return_log_probs and delta.logprobs)):
                    continue  # nothing to show yet (e.g. text a stop string might still cut)
                else:
                    beam = Beam(delta.text, new_ids, delta.logprobs, cum_log_prob,
                                **streamed(delta.output, len(new_ids), first))
                    outputs = make_outputs(names, [[beam]], pad)
                new_ids, first = [], False
                final = delta.finished and last_is_final
                emit(pb.ModelStreamInferResponse(infer_response=self._response(request, outputs, final)))


def _unimplemented(name: str):
    @_rpc
    async def method(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"kiln serve does not implement the {name} RPC "
                            "(no statistics, model repository, shared memory, trace or logging control)")
    method.__name__ = name
    return method


for _name in _UNIMPLEMENTED:
    setattr(KServeServicer, _name, _unimplemented(_name))


def make_server(service: EngineService, config: ServeConfig) -> grpc.aio.Server:
    """The gRPC server with the service added; the caller adds the port and starts it. SO_REUSEPORT is off
    (gRPC turns it on by default): a second server on a taken port must fail, not share it and take clients."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_request_bytes),
                                      ("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service, config), server)
    return server

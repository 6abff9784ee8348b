"""kiln's model for Triton's Python backend; `kiln triton-repo` copies this file to REPO/NAME/1/model.py.

Triton runs it in the Python backend's stub process, where `triton_python_backend_utils` exists (kiln's tests
use a stand-in, tests/triton_stub, and a real Triton in tests/test_triton_server.py). Before importing numpy
and kiln it puts the directories recorded in kiln_env.json first on sys.path (see kiln.serve.tritonserver.repository),
then imports kiln from the package directory recorded there, whatever the server's working directory (_import_kiln);
`initialize` refuses numpy 2 (stubs built for numpy 1 crash on BYTES inputs; the parameter allow_numpy2=true
overrides), a kiln other than the repository's writer, and an engine this kiln cannot read. The model is
decoupled: `execute` parses each
request (the tensors of kiln.serve.tritonserver.schema, named as in TensorRT-LLM's Triton ensemble), hands its
rows to the relay (kiln.serve.tritonserver.relay, which generates through AsyncLLM) and returns None; the responses follow through
each request's response sender:
- stream=true (one row per request): a response per new piece of text, never the prompt; the last one
  carries TRITONSERVER_RESPONSE_COMPLETE_FINAL (or the flag comes alone when the last step added no text);
- otherwise one final response with every row's text: prompt + completion, or only the completion with
  exclude_input_in_output=true.
With return_log_probs, output_log_probs holds the log-probabilities of the tokens a response adds (all of
them, or a streamed piece's) and cum_log_probs the sum over every token so far. The inputs
guided_decoding_guide_type and guided_decoding_guide constrain the output (JSON, a JSON schema, a regex or an
EBNF grammar). An invalid request (a guide xgrammar cannot compile included) gets one error response with the
final flag; a request whose client cancelled is aborted, freeing its KV blocks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import site
import sys


def _recorded_environment() -> dict:
    """kiln_env.json beside this file (written by `kiln triton-repo`); its python_path goes to the front of
    sys.path (site directories with their .pth files), so the stub's interpreter finds numpy and kiln where
    the repository's writer said."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kiln_env.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        env = json.load(f)
    before = list(sys.path)
    for entry in env.get("python_path", []):
        if entry not in before and os.path.isdir(entry):
            site.addsitedir(entry)
    added = [entry for entry in sys.path if entry not in before]
    sys.path[:] = added + before
    return env


def _import_kiln(env: dict):
    """kiln from its package directory recorded in kiln_env.json (`kiln_dir`), whatever the working directory.

    Triton's Python backend puts its working directory on sys.path, so a plain `import kiln` in a server
    started from a folder holding a `kiln/` directory (the folder above a clone named kiln, say) imports that
    folder instead: a namespace package, found before an editable install's finder, which comes after
    sys.path. Where nothing is recorded (`--no-site-path`) or the recorded directory is absent (another
    machine, a container), working-directory entries whose `kiln` is not a package are dropped from
    sys.path before the plain import. Says on stderr (the server's log) which kiln it loaded."""
    recorded = env.get("kiln_dir")
    init = os.path.join(recorded, "__init__.py") if recorded else ""
    if "kiln" not in sys.modules and os.path.isfile(init):
        spec = importlib.util.spec_from_file_location("kiln", init, submodule_search_locations=[recorded])
        module = importlib.util.module_from_spec(spec)
        sys.modules["kiln"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("kiln", None)
            raise
    else:
        cwd = os.getcwd()
        shadowed = os.path.isdir(os.path.join(cwd, "kiln")) and not os.path.isfile(os.path.join(cwd, "kiln",
                                                                                                "__init__.py"))
        if shadowed:
            sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != cwd]
    import kiln

    if getattr(kiln, "__file__", None) is None:  # a folder named kiln without __init__.py, found on sys.path
        raise ImportError(f"'kiln' is the folder {', '.join(getattr(kiln, '__path__', []))}, not the kiln package")
    print(f"kiln's Triton model: kiln {kiln.__version__} from {os.path.dirname(os.path.abspath(kiln.__file__))}",
          file=sys.stderr, flush=True)
    return kiln


RECORDED = _recorded_environment()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

try:
    kiln = _import_kiln(RECORDED)
    from kiln.engine_format import EngineError, load_engine_spec
    from kiln.runtime.core.outputs import RequestOutput
    from kiln.serve.errors import InvalidRequest
    from kiln.serve.limits import default_max_prompt_chars
    from kiln.serve.lora_modules import server_loras
    from kiln.serve.prompt_work import LARGE_TEXT_CHARS, release_memory
    from kiln.serve.tritonserver.beam_rows import beams_of, check_beam_widths
    from kiln.serve.tritonserver.logits_outputs import streamed
    from kiln.serve.tritonserver.lora_tasks import LoRATasks
    from kiln.serve.tritonserver.repository import BackendParameters
    from kiln.serve.tritonserver.request import (
        Beam,
        TritonRequest,
        check_prompt_sizes,
        check_requested_outputs,
        make_outputs,
        pad_ids,
        parse_request,
    )
    from kiln.serve.tritonserver.schema import INPUTS, OUTPUT_SPECS
except ImportError as e:
    raise ImportError(
        f"kiln's Triton model cannot import kiln ({e}) with the Python at {sys.executable or sys.prefix}: "
        f"install kiln in the Python backend's environment, or write the repository with `kiln triton-repo` "
        f"from a Python where kiln is installed (it records that Python's site directories in kiln_env.json); "
        f"sys.path is {sys.path}") from e

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
NUMPY2_HINT = ('Triton\'s Python backend stub (e.g. the one bundled with nvidia-pytriton 0.7.0, Triton 2.51) '
               'crashes on BYTES inputs with numpy 2: run `pip install "numpy<2"` in the environment of the '
               'stub\'s Python, or `pip install --target DIR "numpy<2"` and write the repository with '
               '`kiln triton-repo --python-path DIR`; if your stub is built for numpy 2, set the parameter '
               'allow_numpy2 to "true" in config.pbtxt')


def check_environment(config: dict, engine_dir: str) -> None:
    """Fails initialize with a message for what is known to break: numpy 2 under a stub built for numpy 1,
    a kiln other than the one that wrote the repository, an engine this kiln cannot read."""
    parameters = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
    major = int(np.__version__.split(".")[0])
    if major >= 2 and parameters.get("allow_numpy2", "").strip().lower() != "true":
        raise pb_utils.TritonModelException(f"numpy {np.__version__} (from {os.path.dirname(np.__file__)}) is "
                                            f"imported: {NUMPY2_HINT}")
    kiln_where = os.path.dirname(os.path.abspath(kiln.__file__))
    wrote = RECORDED.get("kiln_version")
    if wrote is not None and wrote != kiln.__version__:
        raise pb_utils.TritonModelException(
            f"this model.py was written by kiln {wrote}, but the Python backend imports kiln {kiln.__version__} "
            f"from {kiln_where}: write the repository again with that kiln (`kiln triton-repo --force`) or make "
            f"kiln {wrote} importable")
    try:
        spec = load_engine_spec(engine_dir, verify_checksums=False)
    except EngineError as e:
        raise pb_utils.TritonModelException(f"kiln {kiln.__version__} (from {kiln_where}) cannot load the engine: "
                                            f"{e}") from e
    if spec.kiln_version != kiln.__version__:
        print(f"kiln's Triton model: the engine {engine_dir} was built by kiln {spec.kiln_version}; serving it "
              f"with kiln {kiln.__version__}", file=sys.stderr)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        """Reads config.pbtxt (as JSON), loads the engine on this instance's device, starts the engine thread."""
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "kiln's model streams responses: config.pbtxt needs model_transaction_policy { decoupled: true }")
        params = BackendParameters.from_strings(
            {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()})
        check_environment(config, params.engine_dir)
        self.llm = load_kiln_engine(params, instance_device(args, params), config.get("max_batch_size") or None)
        # Imported here, on the engine's side only: the ensemble's text models load this file and need no torch.
        from kiln.serve.tritonserver.relay import Relay

        self.relay = Relay(self.llm)
        # TensorRT-LLM's lora_task_id: adapters sent with a task's first request, kept under lora-task-<id>
        self.lora_tasks = LoRATasks(self.llm, server_loras(self.llm, args.get("model_name", "kiln"), ()),
                                    "write the repository with `kiln triton-repo --enable-lora`")
        # A text_input over this is refused before it is tokenized (kiln serve's --max-prompt-chars).
        self.max_prompt_chars = params.max_prompt_chars or default_max_prompt_chars(self.llm.max_seq_len)

    def execute(self, requests: list) -> None:
        """Submits every request to the relay and returns at once (in-flight batching: they join
        the running batch at its next step)."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for spec in INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is not None:
                        inputs[spec.name] = tensor.as_numpy()
                rows = parse_request(inputs)
                check_prompt_sizes(rows, self.max_prompt_chars, "config.pbtxt parameter max_prompt_chars")
                check_beam_widths(self.llm, rows)
                names = check_requested_outputs(_named_outputs(request), rows)
                if len(rows) > 1 and any(row.stream for row in rows):
                    raise InvalidRequest("stream=true takes one prompt per request (batch size 1)", "stream")
                loras = self._loras(rows)
                pads = pad_ids(rows, self.llm.eos_token_ids)
                sink = _StreamSink(sender, names, rows[0], pads) if rows[0].stream else \
                    _WholeSink(sender, rows, names, pads)
                self.relay.submit(self._token_ids(rows), [row.params for row in rows], sink, loras)
            except InvalidRequest as e:
                sender.send(error_response(e.message, "INVALID_ARG"), flags=FINAL)
            except RuntimeError as e:  # the engine has stopped
                sender.send(error_response(str(e), "UNAVAILABLE"), flags=FINAL)
        return None

    def _loras(self, rows: list[TritonRequest]) -> list:
        """Each row's LoRA adapter (None: the base model); a new one is converted and read here, on Triton's
        thread."""
        loras = []
        for i, row in enumerate(rows):
            try:
                loras.append(self.lora_tasks.resolve(row.lora))
            except InvalidRequest as e:
                raise InvalidRequest(e.message if len(rows) == 1 else f"batch row {i}: {e.message}", e.param) from None
        return loras

    def _token_ids(self, rows: list[TritonRequest]) -> list[list[int]]:
        """Every row's prompt tokenized (and checked to fit) here, on Triton's thread: on the engine thread a long
        text would stall every running request. Memory the tokenizer freed goes back to the system after a large
        one."""
        token_ids = []
        for i, row in enumerate(rows):
            try:
                token_ids.append(self.llm.tokenize(row.prompt))
                self.llm.check_fits(len(token_ids[-1]), row.params)  # nor walks a prompt it would refuse
            except ValueError as e:
                raise InvalidRequest(str(e) if len(rows) == 1 else f"batch row {i}: {e}", "text_input") from None
        if sum(len(row.prompt) for row in rows) >= LARGE_TEXT_CHARS:
            release_memory()
        return token_ids

    def finalize(self) -> None:
        """Aborts every request (each gets an error response with the final flag) and stops the engine."""
        self.relay.stop()
        self.llm.shutdown()


def instance_device(args: dict, params: BackendParameters) -> str:
    """The device of this model instance: Triton's instance kind and device id, else the engine's target."""
    kind = args.get("model_instance_kind")
    if kind == "GPU":
        return f"cuda:{args.get('model_instance_device_id', '0')}"
    if kind == "CPU":
        return "cpu"
    return load_engine_spec(params.engine_dir, verify_checksums=False).target.get("device_type", "cpu")


def load_kiln_engine(params: BackendParameters, device: str, max_batch_size: int | None):
    """The engine, as an AsyncLLM (its own engine thread); its KV cache takes kv_cache_free_gpu_mem_fraction of the memory left free once the
    weights are loaded and one step's activations measured (TensorRT-LLM's meaning, kiln's
    --kv-cache-memory-fraction). On the CPU the cache holds max_batch_size sequences of max_seq_len, within
    that share of available host memory."""
    from kiln.runtime import AsyncLLM

    return AsyncLLM(params.engine_dir, options=runtime_options_of(params, device, max_batch_size))


def runtime_options_of(params: BackendParameters, device: str, max_batch_size: int | None):
    """The RuntimeOptions config.pbtxt asks for: its `max_batch_size`, the instance's device, the parameters
    under TensorRT-LLM's names (enable_kv_cache_reuse, kv_cache_free_gpu_mem_fraction, batch_scheduler_policy)
    kiln's LoRA options (enable_lora, max_loras, max_lora_rank, max_cpu_loras) and the prefix cache's host and disk
    tiers (kv_cache_host_memory_bytes, kv_offloading_dir, kv_offloading_disk_size) and speculative decoding
    (speculative_config); the rest are defaults."""
    from kiln.runtime import RuntimeOptions

    return RuntimeOptions(device=device, max_batch_size=max_batch_size,
                          enable_prefix_caching=params.enable_kv_cache_reuse,
                          kv_cache_memory_fraction=params.kv_cache_free_gpu_mem_fraction,
                          capacity_scheduler_policy=params.batch_scheduler_policy, **params.lora_options(),
                          **params.offloading_options(), **params.speculative_options())


def error_response(message: str, code: str):
    code_value = getattr(pb_utils.TritonError, code, None)  # error codes exist since Triton 23.09
    error = pb_utils.TritonError(message) if code_value is None else pb_utils.TritonError(message, code_value)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _named_outputs(request) -> list[str]:
    names = list(request.requested_output_names())
    # Triton fills in every output of the model when the client names none, so "all of them" is read as
    # "the defaults": the log-prob outputs only for requests with return_log_probs.
    return [] if set(names) == set(OUTPUT_SPECS) else names


def _response(arrays: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in arrays.items()])


class _Sink:
    """One Triton request's way back: its response sender (used on the relay's thread only)."""

    def __init__(self, sender, names: list[str]) -> None:
        self.sender = sender
        self.names = names
        # Response senders tell about cancellation since Triton 23.10; before, a request runs to its end.
        self.cancelled = getattr(sender, "is_cancelled", lambda: False)

    def reject(self, message: str) -> None:
        self.sender.send(error_response(message, "INVALID_ARG"), flags=FINAL)

    def abort(self, message: str | None) -> None:
        if message is None:  # cancelled: nobody reads a response, but Triton still needs the final flag
            self.sender.send(flags=FINAL)
        else:
            self.sender.send(error_response(message, "UNAVAILABLE"), flags=FINAL)

    def fail(self, message: str, client_error: bool) -> None:
        self.sender.send(error_response(message, "INVALID_ARG" if client_error else "INTERNAL"), flags=FINAL)


class _StreamSink(_Sink):
    """stream=true: a response per new piece of text, the last one final. With beam search (which TensorRT-LLM
    cannot stream) a response per update, holding the current beams whole (their generated text and ids)."""

    def __init__(self, sender, names: list[str], request: TritonRequest, pads: list[int]) -> None:
        super().__init__(sender, names)
        self.request = request
        self.pads = pads
        self.text_len = 0
        self.num_logprobs = 0
        self.num_tokens = 0

    def update(self, row: int, output: RequestOutput) -> None:
        if output.beam_outputs is not None:
            arrays = make_outputs(self.names, [beams_of(self.request, output, whole=False)], self.pads)
            self.sender.send(_response(arrays), flags=FINAL if output.finished else 0)
            return
        piece = output.text[self.text_len:]
        logprobs = output.logprobs or []
        new_logprobs = logprobs[self.num_logprobs:]
        self.text_len, self.num_logprobs = len(output.text), len(logprobs)
        flags = FINAL if output.finished else 0
        if not piece and not new_logprobs:
            if output.finished:
                self.sender.send(flags=FINAL)
            return
        new_ids = output.token_ids[self.num_tokens:]
        beam = Beam(piece, new_ids, new_logprobs, sum(logprobs),  # cum_log_probs: a running total
                    **streamed(output, len(new_ids), self.num_tokens == 0))
        self.num_tokens = len(output.token_ids)
        self.sender.send(_response(make_outputs(self.names, [[beam]], self.pads)), flags=flags)


class _WholeSink(_Sink):
    """stream=false: one final response once every row has finished."""

    def __init__(self, sender, rows: list[TritonRequest], names: list[str], pads: list[int]) -> None:
        super().__init__(sender, names)
        self.rows = rows
        self.pads = pads
        self.outputs: list[RequestOutput | None] = [None] * len(rows)

    def update(self, row: int, output: RequestOutput) -> None:
        self.outputs[row] = output
        if not all(out is not None and out.finished for out in self.outputs):
            return
        beams = [beams_of(request, out) for request, out in zip(self.rows, self.outputs)]
        self.sender.send(_response(make_outputs(self.names, beams, self.pads)), flags=FINAL)

"""LoRA through the Triton/KServe protocol, TensorRT-LLM's way: `lora_task_id` with `lora_weights` +
`lora_config` (made here from real PEFT adapters exactly as TensorRT-LLM's hf_lora_convert.py makes them) the
first time, the id alone afterwards. tritonclient over kiln serve's HTTP and gRPC, the generate extension, the
errors, and the repository model in a real Triton server (skipped where tritonserver is not installed)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from lora_util import make_adapter
from safetensors.torch import load_file, save_file
from serve_util import MODEL_NAME, start_server
from tritonclient.utils import InferenceServerException

from kiln.checkpoints.trtllm_lora import MODULE_IDS
from kiln.runtime import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

BUNDLED = Path(__file__).resolve().parent.parent / "examples" / "kiln-tiny-code"
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
MAX_TOKENS = 8
RANK_LIMIT = 16
# hf_lora_convert.py's mapping (Llama): gate_proj is TensorRT-LLM's fc (mlp_h_to_4h), up_proj its gate (mlp_gate)
HF_TO_TRTLLM = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
                "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h"}


def fp16_exact(directory: Path) -> Path:
    """Rounds the adapter's factors to float16 in place, so TensorRT-LLM's FP16 lora_weights carry it exactly
    (the scalings used below are powers of two, exact in float16 too)."""
    file = directory / "adapter_model.safetensors"
    save_file({k: v.half().float().contiguous() for k, v in load_file(file).items()}, file)
    return directory


def to_trtllm(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """A PEFT adapter -> (lora_weights [1, N, L] FP16, lora_config [1, N, 3] INT32), as hf_lora_convert.py
    writes them: per layer and module, A [r, in] flattened then B [out, r] * (lora_alpha / r) flattened, rows
    zero-padded to the longest; config rows [module_id, layer_idx, r]."""
    config = json.loads((directory / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(directory / "adapter_model.safetensors")
    rows, keys = [], []
    for name in sorted(k for k in tensors if k.endswith("lora_A.weight")):
        parts = name.split(".")
        layer, module = int(parts[parts.index("layers") + 1]), parts[-3]
        a, b = tensors[name], tensors[name.replace("lora_A", "lora_B")]
        rows.append(torch.cat([a.flatten(), (b * scale).flatten()]).half())
        keys.append([MODULE_IDS[HF_TO_TRTLLM[module]], layer, a.shape[0]])
    width = max(r.numel() for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    return weights.numpy()[None], np.array(keys, dtype=np.int32)[None]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    return {"attn": fp16_exact(make_adapter(base, root / "attn", 11, r=8, lora_alpha=16,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])[0]),
            "mlp": fp16_exact(make_adapter(base, root / "mlp", 12, r=4, lora_alpha=16,
                                           target_modules=["gate_proj", "up_proj", "down_proj"])[0])}


@pytest.fixture(scope="module")
def expected(tiny_code_engine, adapters):
    """Greedy text per (adapter or None, prompt) from LLM.generate with the PEFT adapter as a LoRARequest."""
    llm = LLM(tiny_code_engine, enable_lora=True, max_loras=2, max_lora_rank=RANK_LIMIT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    texts = {}
    for i, name in enumerate([None, "attn", "mlp"]):
        lora = None if name is None else LoRARequest(name, i, str(adapters[name]))
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, lora_request=lora)):
            texts[name, prompt] = out.text
    for name in ("attn", "mlp"):  # else the comparison proves nothing
        assert any(texts[name, p] != texts[None, p] for p in PROMPTS), name
    llm.shutdown()
    return texts


@pytest.fixture(scope="module")
def lora_server(tiny_code_engine):
    srv = start_server(tiny_code_engine, enable_lora=True, max_loras=2, max_lora_rank=RANK_LIMIT)
    yield srv
    srv.stop()


def tensors(module, prompt: str, task_id: int | None = None, lora: tuple | None = None, stream: bool | None = None):
    """tritonclient inputs (`module`: tritonclient.http or .grpc) of one request."""
    arrays = [("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[MAX_TOKENS]], dtype=np.int32), "INT32")]
    if task_id is not None:
        arrays.append(("lora_task_id", np.array([[task_id]], dtype=np.uint64), "UINT64"))
    if lora is not None:
        arrays += [("lora_weights", lora[0], "FP16"), ("lora_config", lora[1], "INT32")]
    if stream is not None:
        arrays.append(("stream", np.array([[stream]], dtype=bool), "BOOL"))
    out = []
    for name, array, datatype in arrays:
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def http_text(client, prompt: str, **kw) -> str:
    return client.infer(MODEL_NAME, tensors(httpclient, prompt, **kw)).as_numpy("text_output")[0][0].decode()


def grpc_text(client, prompt: str, **kw) -> str:
    return client.infer(MODEL_NAME, tensors(grpcclient, prompt, **kw)).as_numpy("text_output")[0][0].decode()


def http_error(client, prompt: str, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL_NAME, tensors(httpclient, prompt, **kw))
    assert e.value.status() == "400", e.value
    return e.value


def test_http_and_grpc_select_the_adapter_then_the_id_alone(lora_server, adapters, expected):
    http = httpclient.InferenceServerClient(url=lora_server.http_url)
    grpc = grpcclient.InferenceServerClient(url=lora_server.grpc_url)
    attn, mlp = to_trtllm(adapters["attn"]), to_trtllm(adapters["mlp"])
    p0, p1 = PROMPTS
    assert http_text(http, p0, task_id=7, lora=attn) == p0 + expected["attn", p0]
    assert http_text(http, p1, task_id=7) == p1 + expected["attn", p1]  # the id alone
    assert grpc_text(grpc, p0, task_id=7) == p0 + expected["attn", p0]
    assert http_text(http, p0, task_id=7, lora=attn) == p0 + expected["attn", p0]  # the same weights again
    assert grpc_text(grpc, p1, task_id=0, lora=mlp) == p1 + expected["mlp", p1]  # task id 0 is a task too
    assert http_text(http, p0, task_id=0) == p0 + expected["mlp", p0]
    assert http_text(http, p0) == p0 + expected[None, p0]  # no lora_task_id: the base model
    # gRPC stream (decoupled, as Triton serves TensorRT-LLM), text pieces
    responses: queue.SimpleQueue = queue.SimpleQueue()
    grpc.start_stream(lambda result, error: responses.put((result, error)))
    try:
        grpc.async_stream_infer(MODEL_NAME, tensors(grpcclient, p1, task_id=7, stream=True))
        pieces = []
        while True:
            result, error = responses.get(timeout=60)
            assert error is None, error
            pieces += [t.decode() for t in result.as_numpy("text_output").reshape(-1)]
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        grpc.stop_stream()
    assert "".join(pieces) == expected["attn", p1]
    # the generate extension: the id alone
    body = json.dumps({"text_input": p1, "max_tokens": MAX_TOKENS, "lora_task_id": 0}).encode()
    url = f"{lora_server.http_base}/v2/models/{MODEL_NAME}/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        assert json.loads(response.read())["text_output"] == p1 + expected["mlp", p1]
    # served as named adapters: counted per adapter, unloadable through vLLM's route
    assert set(lora_server.service.loras.names) == {"lora-task-7", "lora-task-0"}
    metrics = urllib.request.urlopen(lora_server.metrics_url, timeout=10).read().decode()
    assert 'kiln_lora_requests_total{lora_name="lora-task-7"} 5.0' in metrics
    assert "kiln_lora_adapters_loaded 2.0" in metrics


def test_metadata_and_config_list_the_lora_inputs(lora_server):
    http = httpclient.InferenceServerClient(url=lora_server.http_url)
    inputs = {t["name"]: t for t in http.get_model_metadata(MODEL_NAME)["inputs"]}
    assert inputs["lora_task_id"]["datatype"] == "UINT64" and inputs["lora_task_id"]["shape"] == [-1, 1]
    assert inputs["lora_weights"]["datatype"] == "FP16" and inputs["lora_weights"]["shape"] == [-1, -1, -1]
    assert inputs["lora_config"]["datatype"] == "INT32" and inputs["lora_config"]["shape"] == [-1, -1, 3]
    config = {t["name"]: t for t in http.get_model_config(MODEL_NAME)["input"]}
    assert config["lora_weights"]["data_type"] == "TYPE_FP16" and config["lora_weights"]["optional"]
    grpc = grpcclient.InferenceServerClient(url=lora_server.grpc_url)
    config = {t.name: t for t in grpc.get_model_config(MODEL_NAME).config.input}
    assert list(config["lora_config"].dims) == [-1, 3]


def rows(lora: tuple) -> tuple[np.ndarray, np.ndarray]:
    return lora[0].copy(), lora[1].copy()


def test_bad_lora_requests_are_400_naming_the_input(lora_server, adapters):
    http = httpclient.InferenceServerClient(url=lora_server.http_url)
    attn = to_trtllm(adapters["attn"])
    p = PROMPTS[0]
    e = http_error(http, p, task_id=99)
    assert "LoRA task 99 not found in cache. Please send LoRA weights with request" in str(e)
    weights, config = rows(attn)
    config[0, 0, 0] = 9  # cross_attn_q
    assert "module_id 9 (cross_attn_q)" in str(http_error(http, p, task_id=21, lora=(weights, config)))
    weights, config = rows(attn)
    config[0, 3, 1] = 8
    e = str(http_error(http, p, task_id=22, lora=(weights, config)))
    assert "lora_config' row 3" in e and "layer_idx 8" in e and "8 layers" in e
    weights, config = rows(attn)
    config[0, 0, 2] = 32
    e = str(http_error(http, p, task_id=23, lora=(weights, config)))
    assert "adapter_size 32" in e and "max_lora_rank=16" in e
    weights, config = rows(attn)
    e = str(http_error(http, p, task_id=24, lora=(weights[:, :, :100], config)))
    assert "lora_weights' row 0 has 100 values" in e
    e = str(http_error(http, p, task_id=25, lora=(weights[:, :3], config)))
    assert "lora_weights" in e and "[3, " in e
    weights, config = rows(attn)
    weights[0, 0, 0] = np.inf
    assert "not finite" in str(http_error(http, p, task_id=26, lora=(weights, config)))
    # the same task id with other weights: refused (TensorRT-LLM would keep the cached ones, silently)
    assert http_text(http, p, task_id=27, lora=attn).startswith(p)
    weights, config = rows(attn)
    weights[0, 0, 5] += 1
    e = str(http_error(http, p, task_id=27, lora=(weights, config)))
    assert "LoRA task 27 is already loaded" in e and "lora-task-27" in e
    # lora_weights without lora_config, or without the task id
    with pytest.raises(InferenceServerException, match="lora_config' is missing"):
        inputs = tensors(httpclient, p, task_id=28)
        extra = httpclient.InferInput("lora_weights", list(attn[0].shape), "FP16")
        extra.set_data_from_numpy(attn[0])
        http.infer(MODEL_NAME, inputs + [extra])
    with pytest.raises(InferenceServerException, match="lora_task_id' is missing"):
        http.infer(MODEL_NAME, tensors(httpclient, p, lora=attn))
    # gRPC: INVALID_ARGUMENT
    grpc = grpcclient.InferenceServerClient(url=lora_server.grpc_url)
    with pytest.raises(InferenceServerException, match="LoRA task 98 not found in cache") as e:
        grpc.infer(MODEL_NAME, tensors(grpcclient, p, task_id=98))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert not any(n.startswith("lora-task-2") and n != "lora-task-27" for n in lora_server.service.loras.names)


def test_an_unloaded_task_needs_its_weights_again(lora_server, adapters, expected):
    from serve_util import post_json

    http = httpclient.InferenceServerClient(url=lora_server.http_url)
    attn, p = to_trtllm(adapters["attn"]), PROMPTS[0]
    assert http_text(http, p, task_id=31, lora=attn) == p + expected["attn", p]
    assert lora_server.service.loras.users("lora-task-31") == 0  # released once the request is over
    assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "lora-task-31"})[0] == 200
    assert "LoRA task 31 not found in cache" in str(http_error(http, p, task_id=31))
    assert http_text(http, p, task_id=31, lora=attn) == p + expected["attn", p]


def test_lora_inputs_without_enable_lora(server, adapters):
    http = httpclient.InferenceServerClient(url=server.http_url)
    e = http_error(http, PROMPTS[0], task_id=1, lora=to_trtllm(adapters["attn"]))
    assert "lora_task_id" in str(e) and "--enable-lora" in str(e)


# ---- the repository model in a real Triton server -------------------------------------------------------
def test_real_triton_repository_model_selects_the_adapter(tiny_code_engine, adapters, expected, tmp_path):
    from triton_server_util import Unavailable, find_install, layout_backend
    from triton_server_util import start_server as start_triton

    from kiln.serve.tritonserver.repository import write_repository

    try:
        install = find_install()
    except Unavailable as e:
        pytest.skip(str(e))
    backends, numpy_dir = layout_backend(install, tmp_path)
    model = "kiln-lora"
    write_repository(tiny_code_engine, tmp_path / "models", model_name=model, enable_lora=True, max_loras=2,
                     max_lora_rank=RANK_LIMIT, python_path=[numpy_dir] if numpy_dir else [])
    assert 'key: "enable_lora"' in (tmp_path / "models" / model / "config.pbtxt").read_text()
    server = start_triton(install, tmp_path / "models", backends, tmp_path / "tritonserver.log", load=[model])
    try:
        server.wait_ready(model, 180)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.SimpleQueue = queue.SimpleQueue()
        client.start_stream(lambda result, error: responses.put((result, error)))

        def run(prompt: str, **kw) -> str:
            client.async_stream_infer(model, tensors(grpcclient, prompt, stream=False, **kw))
            result, error = responses.get(timeout=120)
            if error is not None:
                return f"error: {error}"
            return result.as_numpy("text_output")[0][0].decode()

        try:
            p0, p1 = PROMPTS
            assert run(p0, task_id=3, lora=to_trtllm(adapters["attn"])) == p0 + expected["attn", p0]
            assert run(p1, task_id=3) == p1 + expected["attn", p1]
            assert run(p1) == p1 + expected[None, p1]
            assert "LoRA task 4 not found in cache" in run(p0, task_id=4)
        finally:
            client.stop_stream()
    except Exception:
        print(server.log()[-4000:])
        raise
    finally:
        server.stop()


# ---- the converter alone ------------------------------------------------------------------------------
def test_converter_attn_qkv_shares_a_and_refuses_what_it_cannot_serve(tmp_path):
    from kiln.checkpoints.peft import read_lora_adapter
    from kiln.checkpoints.trtllm_lora import TRTLLMLoRAError, convert, write_peft_adapter
    from kiln.model_defs import model_def_for_hf_config

    raw = json.loads((BUNDLED / "config.json").read_text())
    c = model_def_for_hf_config(raw).parse_config(raw)
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, h)), rng.standard_normal((q + 2 * kv, 4))
    o_a, o_b = rng.standard_normal((2, q)), rng.standard_normal((h, 2))
    rows = [np.concatenate([a.ravel(), b.ravel()]), np.concatenate([o_a.ravel(), o_b.ravel()])]
    weights = np.stack([np.pad(r, (0, rows[0].size - r.size)) for r in rows]).astype(np.float16)
    config = np.array([[0, 5, 4], [4, 2, 2]], dtype=np.int32)
    tensors = convert(weights, config, c, max_lora_rank=16)
    key = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"
    a16, b16 = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    for module, rows_of_b in (("q_proj", b16[:q]), ("k_proj", b16[q:q + kv]), ("v_proj", b16[q + kv:])):
        assert np.array_equal(tensors[key.format(5, module, "A")], a16)
        assert np.array_equal(tensors[key.format(5, module, "B")], rows_of_b)
    # o_proj's rank 2 padded to the adapter's 4 with zeros
    assert tensors[key.format(2, "o_proj", "A")].shape == (4, q)
    assert not tensors[key.format(2, "o_proj", "A")][2:].any() and not tensors[key.format(2, "o_proj", "B")][:, 2:].any()
    write_peft_adapter(tmp_path / "qkv", tensors)
    adapter = read_lora_adapter(tmp_path / "qkv", c, max_lora_rank=16)
    part = adapter.get("model.layers.5.self_attn.qkv_proj").parts[1]  # k_proj, scaling 1
    assert part.scaling == 1.0 and torch.equal(part.b, torch.from_numpy(b16[q:q + kv]))

    def refused(config_rows, match, w=weights):
        with pytest.raises(TRTLLMLoRAError, match=match):
            convert(w, np.array(config_rows, dtype=np.int32), c, max_lora_rank=16)

    refused([[0, 5, 4], [1, 5, 2]], r"row 1 .*attn_q adapts q_proj of layer 5, which row 0 already adapts")
    refused([[18, 0, 4], [4, 2, 2]], r"module_id 18 \(mlp_gate_up\) is not a module kiln can adapt")
    refused([[0, -1, 4], [4, 2, 2]], "layer_idx -1")
    refused([[0, 5, 4, 1], [4, 2, 2, 0]], "is_dora=1")
    refused([[0, 5, 4]], r"lora_weights' has shape \[2, ")


def test_triton_repo_lora_options_reach_the_runtime(tiny_code_engine, tmp_path):
    from kiln.serve.tritonserver.repository import BackendParameters, write_repository

    params = BackendParameters("/e", enable_lora=True, max_loras=3, max_lora_rank=32)
    strings = params.to_strings()
    assert strings["enable_lora"] == "true" and strings["max_lora_rank"] == "32" and "max_cpu_loras" not in strings
    assert BackendParameters.from_strings(strings) == params
    assert params.lora_options() == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 32}
    assert "enable_lora" not in BackendParameters("/e").to_strings()
    with pytest.raises(ValueError, match="max_lora_rank='x' must be a positive integer"):
        BackendParameters.from_strings({"engine_dir": "/e", "max_lora_rank": "x"})
    with pytest.raises(ValueError, match="need --enable-lora"):
        write_repository(tiny_code_engine, tmp_path, max_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        write_repository(tiny_code_engine, tmp_path, enable_lora=True, max_loras=2, max_cpu_loras=1)

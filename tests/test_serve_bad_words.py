"""Bad words, word lists and biases through every door (issue 35, item 2): TensorRT-LLM's bad_words /
stop_words strings, bad_words_list / stop_words_list in its [2, len] offsets layout and embedding_bias through
tritonclient (HTTP and gRPC), OpenAI's logit_bias and vLLM's bad_words through the openai client; each equals
LLM.generate with the same SamplingParams, and bad values are 400s naming the field."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_util import EXAMPLES, MODEL_NAME
from tritonclient.utils import InferenceServerException

from kiln.runtime import LLM, SamplingParams
from kiln.serve.tritonserver.schema import DATATYPES

PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n   "
MAX_TOKENS = 8
VOCAB = 8192


@pytest.fixture(scope="module")
def llm(tiny_code_engine):
    llm = LLM(tiny_code_engine)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EXAMPLES / "kiln-tiny-code")


def expected(llm, **kwargs) -> str:
    return llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **kwargs))[0].text


def to_word_list_format(tokenizer, words: list[str]) -> np.ndarray:
    """TensorRT-LLM's preprocessing model's _to_word_list_format for one row: [1, 2, len] INT32."""
    ids, offsets = [], []
    for word in words:
        ids += tokenizer.encode(word, add_special_tokens=False)
        offsets.append(len(ids))
    pad = max(1, len(ids))
    return np.array([[ids + [0] * (pad - len(ids)), offsets + [-1] * (pad - len(offsets))]], dtype=np.int32)


def infer(module, url: str, **extra) -> str:
    """One greedy request through tritonclient `module` (http or grpc); extra inputs as arrays with a batch dim."""
    values = {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
              "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32),
              "exclude_input_in_output": np.array([[True]], dtype=np.bool_), **extra}
    tensors = []
    for name, array in values.items():
        datatype = next(k for k, (_, dtype) in DATATYPES.items() if np.dtype(dtype) == array.dtype)
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client = module.InferenceServerClient(url)
    try:
        return client.infer(MODEL_NAME, tensors).as_numpy("text_output").ravel()[0].decode()
    finally:
        client.close()


@pytest.fixture(params=["http", "grpc"])
def door(request, server):
    return (httpclient, server.http_url) if request.param == "http" else (grpcclient, server.grpc_url)


def test_bad_words_and_stop_words_strings(door, llm):
    text = infer(*door, bad_words=np.array([[b"def", b""]], dtype=np.object_))
    assert text == expected(llm, bad_words=["def"]) and "def" not in text
    plain = expected(llm)
    stop = plain[3:6]
    assert infer(*door, stop_words=np.array([[stop.encode()]], dtype=np.object_)) == expected(llm, stop=[stop])


def test_word_lists_in_tensorrt_llm_layout(door, llm, tokenizer):
    bad = to_word_list_format(tokenizer, ["def", " def"])
    assert infer(*door, bad_words_list=bad) == expected(llm, bad_words_token_ids=[[322], [367]])
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    stop_ids = plain.token_ids[2:4]
    stops = np.array([[stop_ids, [2, -1]]], dtype=np.int32)
    text = infer(*door, stop_words_list=stops)
    assert text == expected(llm, stop_token_sequences=[stop_ids]) == plain.text[:plain.text.index(
        tokenizer.decode(stop_ids))]
    empty = np.zeros((1, 2, 0), dtype=np.int32)  # what the preprocessing model sends for no words
    assert infer(*door, bad_words_list=empty, stop_words_list=empty) == plain.text


def test_embedding_bias(door, llm):
    bias = np.zeros((1, VOCAB), dtype=np.float32)
    bias[0, 292] = 100.0  # "self", forced
    assert infer(*door, embedding_bias=bias) == expected(llm, logit_bias={292: 100.0}) == "self" * MAX_TOKENS
    assert infer(*door, embedding_bias=np.zeros((1, 0), dtype=np.float32)) == expected(llm)


@pytest.mark.parametrize("extra, name", [
    (dict(bad_words_list=np.array([[[322, 367], [3, -1]]], dtype=np.int32)), "bad_words_list"),
    (dict(stop_words_list=np.array([[[5, 6, 7]]], dtype=np.int32)), "stop_words_list"),
    (dict(bad_words_list=np.array([[[VOCAB], [1]]], dtype=np.int32)), "bad_words_list"),
    (dict(embedding_bias=np.full((1, 3), np.inf, dtype=np.float32)), "embedding_bias"),
    (dict(embedding_bias=np.ones((1, VOCAB + 1), dtype=np.float32)), "embedding_bias"),
    (dict(bad_words=np.array([[b"   "]], dtype=np.object_)), "bad_words"),
])
def test_bad_word_inputs_are_refused_naming_them(server, extra, name):
    with pytest.raises(InferenceServerException, match=name) as e:
        infer(httpclient, server.http_url, **extra)
    assert e.value.status() == "400"


def test_openai_logit_bias_and_bad_words(server, llm):
    client = openai.OpenAI(base_url=server.http_base + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    logit_bias={"292": 100})
    assert out.choices[0].text == "self" * MAX_TOKENS
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"bad_words": ["def"]})
    assert out.choices[0].text == expected(llm, bad_words=["def"])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logit_bias={"292": 100})
    assert chat.choices[0].message.content == "self" * 4
    for bias, param in (({"292": 101}, "logit_bias"), ({"x": 1}, "logit_bias"), ({str(VOCAB): 1}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert e.value.body["param"] == param

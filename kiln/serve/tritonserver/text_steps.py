"""The ensemble layout's `preprocessing` and `postprocessing` models (layout.py): text <-> token ids with the
engine's tokenizer, in their own Python-backend processes (no engine, no torch).

preprocessing encodes text_input as the engine does (so the ids equal the single model's) and each stop/bad word
without special tokens into TensorRT-LLM's word-list layout ([2, len]: the words' ids one after another, then
each word's end offset, padded with 0 and -1); an end_id or pad_id not given goes on as -1 ("the model's
own"), not as the tokenizer's EOS, so a model with several end tokens keeps them all. postprocessing decodes
output_ids[:sequence_length] per beam, special tokens skipped, as kiln's detokenizer does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from kiln.serve.errors import InvalidRequest
from kiln.serve.limits import check_prompt_chars, default_max_prompt_chars


def load_tokenizer(engine_dir: str):
    """The engine's tokenizer (its tokenizer/ folder), as the runtime loads it."""
    from transformers import AutoTokenizer

    from kiln.engine_format import load_engine_spec

    spec = load_engine_spec(engine_dir, verify_checksums=False)
    if spec.tokenizer_dir is None:
        raise ValueError(f"the engine {engine_dir} has no tokenizer: the ensemble layout needs one "
                         "(serve token ids through the single-model layout instead)")
    tokenizer = AutoTokenizer.from_pretrained(str(spec.tokenizer_dir))
    tokenizer.model_max_length = sys.maxsize  # lengths are the engine's to check
    return tokenizer, int(spec.build_config["max_seq_len"])


def decode(tokenizer, ids: Sequence[int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=True)
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def word_list(tokenizer, words: Sequence[str]) -> np.ndarray:
    """Words -> TensorRT-LLM's [2, len] layout (preprocessing's _to_word_list_format); empty words are skipped."""
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        word_ids = tokenizer.encode(word, add_special_tokens=False) if word else []
        if word_ids:
            ids += word_ids
            offsets.append(len(ids))
    width = max(1, len(ids))
    return np.array([ids + [0] * (width - len(ids)), offsets + [-1] * (width - len(offsets))], dtype=np.int32)


def words_of(tokenizer, words: np.ndarray | None, name: str) -> list[str]:
    """A [2, len] word list -> each word's text (kiln matches stop and bad words on text, not on ids)."""
    from kiln.serve.tritonserver.word_lists import parse_word_list

    if words is None or np.asarray(words).size == 0:
        return []
    return [decode(tokenizer, ids) for ids in parse_word_list(name, words)]


def _text(value) -> str:
    return value if isinstance(value, str) else bytes(value).decode("utf-8")


def _padded(rows: list[np.ndarray], pad, dtype) -> np.ndarray:
    shape = tuple(max(r.shape[i] for r in rows) for i in range(rows[0].ndim))
    out = np.full((len(rows), *shape), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[(i, *(slice(0, n) for n in row.shape))] = row
    return out


def preprocess(tokenizer, inputs: dict[str, np.ndarray], max_prompt_chars: int) -> dict[str, np.ndarray]:
    """preprocessing's outputs for one request (every input [batch, ...]); InvalidRequest names the input."""
    queries = np.asarray(inputs["QUERY"]).reshape(len(inputs["QUERY"]), -1)
    batch = queries.shape[0]
    ids, stops, bads = [], [], []
    for i in range(batch):
        try:
            text = _text(queries[i][0])
        except (UnicodeDecodeError, TypeError):
            raise InvalidRequest("input 'text_input' must hold UTF-8 strings", "text_input") from None
        check_prompt_chars("input 'text_input'", len(text), max_prompt_chars, "text_input",
                           "config.pbtxt parameter max_prompt_chars")
        if not text:
            raise InvalidRequest("input 'text_input' is empty", "text_input")
        ids.append(np.array(tokenizer.encode(text), dtype=np.int32))
        for name, out in (("STOP_WORDS_DICT", stops), ("BAD_WORDS_DICT", bads)):
            words = inputs.get(name)
            out.append(word_list(tokenizer, [_text(w) for w in np.asarray(words[i]).reshape(-1)]
                                 if words is not None else []))
    minus_one = np.full((batch, 1), -1, dtype=np.int32)
    return {"INPUT_ID": _padded(ids, 0, np.int32),
            "REQUEST_INPUT_LEN": np.array([[len(x)] for x in ids], dtype=np.int32),
            "BAD_WORDS_IDS": _padded(bads, -1, np.int32), "STOP_WORDS_IDS": _padded(stops, -1, np.int32),
            "REQUEST_OUTPUT_LEN": np.asarray(inputs["REQUEST_OUTPUT_LEN"], dtype=np.int32).reshape(batch, 1),
            "OUT_END_ID": np.asarray(inputs.get("END_ID", minus_one), dtype=np.int32).reshape(batch, 1),
            "OUT_PAD_ID": np.asarray(inputs.get("PAD_ID", minus_one), dtype=np.int32).reshape(batch, 1)}


def postprocess(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[batch, beam, len] ids and [batch, beam] lengths -> [batch, beam] UTF-8 texts."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(tokens.shape[:2])
    out = np.empty(tokens.shape[:2], dtype=np.object_)
    for b in range(tokens.shape[0]):
        for k in range(tokens.shape[1]):
            out[b, k] = decode(tokenizer, tokens[b, k, :int(lengths[b, k])].tolist()).encode("utf-8")
    return out


class TextStep:
    """The model.py side of preprocessing / postprocessing: each request answered at once (not decoupled)."""

    def __init__(self, base, role: str) -> None:
        self.base, self.role = base, role  # base: the loaded kiln_model.py (pb_utils, error_response)

    def initialize(self, args: dict, params) -> None:
        self.tokenizer, max_seq_len = load_tokenizer(params.engine_dir)
        self.max_prompt_chars = params.max_prompt_chars or default_max_prompt_chars(max_seq_len)

    def execute(self, requests: list) -> list:
        from kiln.serve.tritonserver.layout import model_tensors

        pb = self.base.pb_utils
        inputs_of, _ = model_tensors(self.role)
        responses = []
        for request in requests:
            try:
                inputs = {spec.name: t.as_numpy() for spec in inputs_of
                          if (t := pb.get_input_tensor_by_name(request, spec.name)) is not None}
                if self.role == "preprocessing":
                    arrays = preprocess(self.tokenizer, inputs, self.max_prompt_chars)
                else:
                    arrays = {"OUTPUT": postprocess(self.tokenizer, inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"])}
                responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in arrays.items()]))
            except InvalidRequest as e:
                responses.append(self.base.error_response(e.message, "INVALID_ARG"))
        return responses

    def finalize(self) -> None:
        pass

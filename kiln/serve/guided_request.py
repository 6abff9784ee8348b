"""Structured output: the request fields that ask for it -> the runtime's `GuidedDecoding`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's extras `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` and its newer `structured_outputs` object, on /v1/completions and
/v1/chat/completions (at most one of them per request); and Triton's inputs `guided_decoding_guide_type` and
`guided_decoding_guide`, with TensorRT-LLM's type names. A malformed field is an InvalidRequest naming it.

A schema, regex or grammar that is well-formed here but that xgrammar cannot compile is found by the engine
when the request is added (a ValueError whose message starts `guided_decoding.`): `engine_refusal` turns it
into an InvalidRequest naming the request field it came from.
"""

from __future__ import annotations

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.serve.client_json import shown
from kiln.serve.errors import InvalidRequest

# The OpenAI / vLLM fields that constrain the output, in the order an error lists them.
OPENAI_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
# vLLM's `structured_outputs` keys -> GuidedDecoding's fields
_STRUCTURED_OUTPUTS = {"json": "json", "json_object": "json_object", "regex": "regex", "grammar": "grammar",
                       "choice": "choice"}

# Triton's inputs, named and typed as in TensorRT-LLM's ensemble (`guided_decoding_guide_type`: json = any JSON
# object, json_schema, regex, ebnf_grammar) -> GuidedDecoding's field.
GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
# How an engine complaint about a Triton guide names where it came from.
TRITON_GUIDE_LABEL = f"input '{GUIDE_INPUT}'"


# ---- OpenAI -------------------------------------------------------------------------------------------------
def openai_guided(body: dict) -> tuple[GuidedDecoding | None, str | None]:
    """-> (the constraint the request asks for, or None; the field it came from). Two constraining fields are a
    400 naming the second; `response_format: {"type": "text"}` asks for nothing."""
    found: list[tuple[str, GuidedDecoding]] = []
    for field in OPENAI_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        guided = _FIELD_READERS[field](value)
        if guided is not None:
            found.append((field, guided))
    if len(found) > 1:
        names = " and ".join(field for field, _ in found)
        raise InvalidRequest(f"give at most one of {', '.join(OPENAI_FIELDS)} (got {names}): a request's output "
                             "follows one constraint", found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _response_format(value) -> GuidedDecoding | None:
    field = "response_format"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field}={shown(value)} is invalid: must be an object such as "
                             '{"type": "json_object"}', field)
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(f"{field}.type={shown(kind)} is invalid: must be one of {', '.join(RESPONSE_FORMATS)}",
                             field)
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _no_other_keys(value, allowed, field)
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{field}.json_schema={shown(spec)} is invalid: must be an object with 'name' and "
                             "'schema'", field)
    _no_other_keys(spec, _JSON_SCHEMA_KEYS, f"{field}.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{field}.json_schema.name={shown(name)} is invalid: must be a non-empty string", field)
    for key, kind_ok, rule in (("description", str, "a string"), ("strict", bool, "true or false")):
        if spec.get(key) is not None and not isinstance(spec[key], kind_ok):
            raise InvalidRequest(f"{field}.json_schema.{key}={shown(spec[key])} is invalid: must be {rule}", field)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field}.json_schema.schema={shown(schema)} is invalid: must be a JSON schema "
                             "(an object)", field)
    return _guided(field, json=schema)


def _guided_json(value) -> GuidedDecoding:
    if not isinstance(value, (dict, str)):
        raise InvalidRequest(f"guided_json={shown(value)} is invalid: must be a JSON schema (an object, or its "
                             "JSON text)", "guided_json")
    return _guided("guided_json", json=value)


def _text_field(field: str, key: str):
    def read(value) -> GuidedDecoding:
        if not isinstance(value, str):
            raise InvalidRequest(f"{field}={shown(value)} is invalid: must be a string", field)
        return _guided(field, **{key: value})
    return read


def _guided_choice(value) -> GuidedDecoding:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise InvalidRequest(f"guided_choice={shown(value)} is invalid: must be a list of strings", "guided_choice")
    return _guided("guided_choice", choice=value)


def _structured_outputs(value) -> GuidedDecoding | None:
    """vLLM's `structured_outputs`: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    {"json_object": true}; null and false values are left out, as vLLM does."""
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field}={shown(value)} is invalid: must be an object such as "
                             '{"regex": "[0-9]+"}', field)
    _no_other_keys(value, set(_STRUCTURED_OUTPUTS), field)
    given = {_STRUCTURED_OUTPUTS[key]: v for key, v in value.items() if v is not None and v is not False}
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"{field} sets {', '.join(given)}: give one of {', '.join(_STRUCTURED_OUTPUTS)}",
                             field)
    return _guided(field, **given)


_FIELD_READERS = {"response_format": _response_format, "guided_json": _guided_json,
                  "guided_regex": _text_field("guided_regex", "regex"), "guided_choice": _guided_choice,
                  "guided_grammar": _text_field("guided_grammar", "grammar"),
                  "structured_outputs": _structured_outputs}


def _no_other_keys(value: dict, allowed: set[str] | frozenset[str], where: str) -> None:
    """A key the object does not take is a 400, so that a typo is never silently ignored."""
    for key in value:
        if key not in allowed:
            raise InvalidRequest(f"{where} has the unknown key {shown(key)}; it takes {', '.join(sorted(allowed))}",
                                 where.split(".")[0])


def _guided(field: str, **constraint) -> GuidedDecoding:
    try:
        return GuidedDecoding(**constraint)
    except ValueError as e:
        raise InvalidRequest(f"{field}: {e}", field) from None


# ---- Triton -------------------------------------------------------------------------------------------------
def triton_guided(guide_type: str | None, guide: str | None) -> GuidedDecoding | None:
    """The Triton inputs (None: not given) -> the constraint. A guide without a type, an unknown type, a type
    that needs a guide without one, and a guide with type `json` (which takes none) are refused; an empty type
    with no guide (or an empty one) asks for nothing."""
    if not guide_type:
        if guide:
            raise InvalidRequest(f"input '{GUIDE_INPUT}' needs input '{GUIDE_TYPE_INPUT}' (one of "
                                 f"{', '.join(GUIDE_TYPES)}) to say what it is", GUIDE_TYPE_INPUT)
        return None
    field = GUIDE_TYPES.get(guide_type)
    if field is None:
        raise InvalidRequest(f"input '{GUIDE_TYPE_INPUT}' is {shown(guide_type)}; it must be one of "
                             f"{', '.join(GUIDE_TYPES)}", GUIDE_TYPE_INPUT)
    if field == "json_object":
        if guide:
            raise InvalidRequest(f"input '{GUIDE_INPUT}' is not used with guide type 'json' (any JSON object); "
                                 "give a schema with guide type 'json_schema'", GUIDE_INPUT)
        return GuidedDecoding(json_object=True)
    if not guide:
        raise InvalidRequest(f"guide type '{guide_type}' needs input '{GUIDE_INPUT}' (the "
                             f"{guide_type.replace('_', ' ')})", GUIDE_INPUT)
    try:
        return GuidedDecoding(**{field: guide})
    except ValueError as e:
        raise InvalidRequest(f"{TRITON_GUIDE_LABEL}: {e}", GUIDE_INPUT) from None


# ---- the engine's complaints --------------------------------------------------------------------------------
def is_guided_error(error: Exception) -> bool:
    """Whether the engine refused a request for its constraint (xgrammar could not compile it)."""
    return str(error).startswith("guided_decoding")


def refusal_message(error: Exception, guided_label: str | None) -> str:
    """The engine's message, prefixed with the request field that the constraint came from when it is about
    the constraint (`response_format: guided_decoding.json=... is invalid: ...`)."""
    if guided_label and is_guided_error(error):
        return f"{guided_label}: {error}"
    return str(error)


def engine_refusal(error: Exception, guided_field: str | None) -> InvalidRequest:
    """A ValueError from adding a request -> the InvalidRequest to answer with (param: the field to blame when
    it is the constraint, else None for the caller to fill in)."""
    blamed = guided_field if guided_field and is_guided_error(error) else None
    for field in _CHECKED_BY_ENGINE:  # token ids checked against the model's vocabulary (sampling/bad_words.py)
        if str(error).startswith(f"SamplingParams.{field}="):
            blamed = field
    return InvalidRequest(refusal_message(error, guided_field), blamed)


_CHECKED_BY_ENGINE = ("logit_bias", "bad_words_token_ids", "stop_token_sequences")

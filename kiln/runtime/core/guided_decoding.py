"""What a request's output must match (structured output): a JSON schema, any JSON object, a regex, an EBNF
grammar or one of a list of strings. Plain data, validated at construction (no torch, no xgrammar here);
`grammar_compiler.py` turns it into an xgrammar grammar and `guided_masker.py` enforces it."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields

_FIELDS = ("json", "json_object", "regex", "grammar", "choice")


def _fail(name: str, value: object, rule: str) -> None:
    raise ValueError(f"guided_decoding.{name}={_short(value)} is invalid: {rule}")


def _short(value: object, limit: int = 80) -> str:
    try:
        text = repr(value)
    except RecursionError:  # a deeply nested schema
        text = f"<a {type(value).__name__} nested too deeply to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class GuidedDecoding:
    """Exactly one constraint on the generated text.

    `json`: a JSON schema (a dict, or its JSON text); the output is a JSON value that validates against it.
    `json_object`: True means any JSON object. `regex`: the output fully matches it. `grammar`: an EBNF
    grammar in xgrammar's dialect (GBNF-like, start rule `root`). `choice`: the output is exactly one of
    these strings (a list is accepted and stored as a tuple).

    The request still ends on `max_tokens` (finish_reason "length", output possibly incomplete); it ends
    with finish_reason "stop" as soon as the constraint is complete and cannot go on, or when the model
    picks EOS where the constraint allows ending.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            # A bare string is almost surely a mistake (it would otherwise become a tuple of characters).
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                _fail("choice", self.choice, "must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [name for name in _FIELDS if self._is_set(name)]
        if len(set_fields) != 1:
            given = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(f"guided_decoding must set exactly one of {', '.join(_FIELDS)} (got: {given})")
        if not isinstance(self.json_object, bool):
            _fail("json_object", self.json_object, "must be True or False")
        schema_text = None
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    _fail("json", self.json, f"not valid JSON text ({e})")
                except RecursionError:  # a RuntimeError: would otherwise reach a server as an internal error
                    _fail("json", self.json, "nested too deeply")
            elif isinstance(self.json, dict):
                parsed = self.json
            else:
                _fail("json", self.json, "must be a JSON schema (a dict or its JSON text)")
            if not isinstance(parsed, (dict, bool)):
                _fail("json", self.json, "a JSON schema must be an object (or true/false)")
            try:
                schema_text = _json.dumps(parsed, separators=(",", ":"))
            except (TypeError, ValueError) as e:
                _fail("json", self.json, f"not JSON-serializable ({e})")
            except RecursionError:
                _fail("json", self.json, "nested too deeply")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                _fail(name, value, "must be a non-empty string")
        if self.choice is not None:
            if not self.choice:
                _fail("choice", self.choice, "must list at least one string")
            for c in self.choice:
                if not isinstance(c, str) or c == "":
                    _fail("choice", self.choice, "must be non-empty strings")
        # Computed once: the engine asks for the key of every constrained request.
        object.__setattr__(self, "_schema_text", schema_text)
        object.__setattr__(self, "_key", self._make_key())

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not False if name == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """The field that is set: "json", "json_object", "regex", "grammar" or "choice"."""
        return next(name for name in _FIELDS if self._is_set(name))

    def schema_text(self) -> str:
        """The JSON schema (kind "json") as compact text, as it was when the GuidedDecoding was made. Key
        order is kept, not sorted: the order of a schema's `properties` is the order the output lists them in."""
        return self._schema_text

    def key(self) -> str:
        """A stable text that is equal for equal constraints (the grammar cache's key). A schema given as a
        dict or as JSON text, with any whitespace, has the same key; key order counts (see schema_text)."""
        return self._key

    def _make_key(self) -> str:
        kind = self.kind
        if kind == "json":
            value = self.schema_text()
        elif kind == "json_object":
            value = ""
        elif kind == "choice":
            value = _json.dumps(list(self.choice))
        else:
            value = getattr(self, kind)
        return f"{kind}:{value}"

    # A dict field makes the generated hash fail; hash the key instead so SamplingParams stays hashable.
    def __hash__(self) -> int:
        return hash(self.key())


assert tuple(f.name for f in fields(GuidedDecoding)) == _FIELDS

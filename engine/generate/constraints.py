"""Structured outputs on the host: a grammar per request that says which tokens may come next.

A ``Constraint`` (a JSON schema, any JSON object, a regular expression or a Lark / GBNF
grammar) is compiled by llguidance against the model's tokenizer (``Grammars``: one per
tokenizer, compiled grammars cached per constraint). Each request gets its own ``Matcher``:
``fill`` writes the allowed-token bitmask of its next token (``[ceil(V/32)]`` uint32, bit
``t % 32`` of word ``t // 32``), which the compiled sampler applies before choosing
(``aotlm.core.sampling.constrain``), and ``advance`` feeds it the tokens the graph chose.
Matchers belong to requests, never to batch rows (rows move). When the grammar is complete
only the eos ids stay allowed, so a constrained row ends with eos (or at its length limit).

llguidance rather than xgrammar: its wheel has no dependencies (xgrammar's declares torch and
triton), it computes a mask in microseconds without a per-vocabulary precompile (engine/serve/README.md,
"Structured outputs", has the measurements) and it reads the HF fast tokenizers the project
already builds.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a weak model cannot pad forever
ALL_ONES = np.uint32(0xFFFFFFFF)


class ConstraintError(ValueError):
    """A schema, regex or grammar the library refuses; the message is the library's."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` (one of ``KINDS``) and its source text
    (a JSON schema as canonical JSON, a regex, a Lark / GBNF grammar)."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str, closed: bool = True) -> Constraint:
        """A JSON schema; ``closed`` (the default) treats objects that do not say
        ``additionalProperties`` as closed (``close_objects``), ``closed=False`` keeps JSON
        Schema's letter (extra keys allowed)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
        if closed:
            schema = close_objects(schema)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))  # property order kept

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """A Lark grammar (llguidance's dialect) or a llama.cpp GBNF grammar."""
        return cls("grammar", text)


# keys whose values are subschemas: a map of them, a list of them, or one
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "contains",
               "propertyNames", "not", "if", "then", "else")  # fmt: skip


def _is_object(schema: dict) -> bool:
    t = schema.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or (t is None and "properties" in schema)


def close_objects(schema, here: bool = True):
    """``schema`` with every object that leaves extra keys unspecified closed
    (``"additionalProperties": false``) and every ``prefixItems`` tuple without ``items`` closed
    (``"items": false``), as OpenAI's strict structured outputs and xgrammar's strict mode read a
    schema. What a schema states is kept (``additionalProperties`` / ``unevaluatedProperties`` /
    ``patternProperties`` given, ``items`` given); the members of an ``allOf`` are not closed
    themselves (closing each would forbid the keys the others add), their subschemas are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub, here=key != "allOf") for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    said = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if here and _is_object(out) and not any(k in out for k in said):
        out["additionalProperties"] = False
    if here and "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


def from_response_format(v, closed: bool = True) -> Constraint | None:
    """OpenAI's ``response_format`` (``{"type": "text" | "json_object" | "json_schema",
    "json_schema": {"schema": ...}}``) plus ``{"type": "regex", "regex": ...}`` and
    ``{"type": "grammar", "grammar": ...}``; None for text. ``ConstraintError`` names the problem.
    A JSON schema's objects are closed (``close_objects``) unless its ``strict`` is false, or it
    does not say and ``closed`` (the server's default) is False."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise ConstraintError("'response_format' must be an object with a 'type'")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ConstraintError("'response_format.json_schema' must be {'name', 'schema': {...}}")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ConstraintError("'response_format.json_schema.strict' must be true or false")
        return Constraint.json_schema(js.get("schema", {}), closed=closed if strict is None else strict)
    if kind in ("regex", "grammar"):
        text = v.get(kind)
        if not isinstance(text, str) or not text:
            raise ConstraintError(f"'response_format.{kind}' must be a non-empty string")
        return Constraint.regex(text) if kind == "regex" else Constraint.grammar(text)
    raise ConstraintError(
        f"'response_format.type' must be text, json_object, json_schema, regex or grammar, got {kind!r}"
    )


def words(vocab: int) -> int:
    return -(-vocab // 32)


def _llguidance():
    try:
        import llguidance  # local: the optional [structured] extra, needed only by constrained requests
        import llguidance.hf  # local: as above
        import llguidance.numpy  # local: as above
    except ImportError:
        raise ConstraintError(
            "structured outputs need llguidance: pip install 'aotlm[structured]' (or llguidance)"
        ) from None
    return llguidance


class Matcher:
    """One request's grammar state: ``fill`` its next mask, ``advance`` with chosen tokens."""

    def __init__(self, matcher, vocab: int, eos_ids: Sequence[int]):
        self._m, self.vocab, self.eos_ids = matcher, vocab, tuple(eos_ids)

    def fill(self, out: np.ndarray) -> np.ndarray:
        """Write the allowed-token bitmask of the next token into ``out`` (``[words(V)]`` uint32).

        Never all-zero: a matcher in an error state (a token it did not allow, which the mask
        prevents) allows the eos ids, so the row ends rather than choosing from nothing.
        """
        llg = _llguidance()
        view = out.reshape(1, -1).view(np.int32)
        llg.numpy.fill_next_token_bitmask(self._m, view, 0)
        if not out.any():
            out[:] = 0
            ids = [t for t in self.eos_ids if 0 <= t < self.vocab] or range(self.vocab)
            for t in ids:
                out[t // 32] |= np.uint32(1 << (t % 32))
        return out

    def mask(self) -> np.ndarray:
        return self.fill(np.zeros(words(self.vocab), np.uint32))

    def advance(self, tokens: Iterable[int]) -> bool:
        """Feed the chosen tokens; False once the matcher is in an error state."""
        for t in tokens:
            if self._m.is_stopped():
                break
            self._m.consume_token(int(t))
        return not self._m.is_error()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match."""
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar text for ``c`` (not yet checked)."""
    llg = _llguidance()
    if c.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)
    if c.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.source)
    if c.kind == "grammar":
        try:
            return llg.grammar_from("grammar", c.source)
        except ValueError as e:
            raise ConstraintError(str(e)) from None
    raise ConstraintError(f"unknown constraint kind {c.kind!r}; use one of {', '.join(KINDS)}")


def check(c: Constraint) -> None:
    """``ConstraintError`` with llguidance's message when ``c``'s schema, regex or grammar is invalid;
    needs no tokenizer, so a command checks its constraints before a model loads."""
    try:
        error = _llguidance().LLMatcher.validate_grammar(grammar_text(c), None)
    except ValueError as e:
        raise ConstraintError(str(e)) from None
    if error:
        raise ConstraintError(error)


class Grammars:
    """llguidance's view of one tokenizer and the grammars compiled against it (LRU cache).

    ``vocab`` is the model's vocabulary (may exceed the tokenizer's: padded embeddings);
    ``eos_ids`` the ids that end a row (allowed once the grammar is complete).
    """

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int], cache_size: int = 256):
        llg = _llguidance()
        self.vocab, self.eos_ids = vocab, tuple(int(t) for t in eos_ids if int(t) >= 0)
        try:
            self.tokenizer = llg.hf.from_tokenizer(
                tokenizer, n_vocab=vocab, eos_token=list(self.eos_ids) or None
            )
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"structured outputs need a fast HF tokenizer: {e}") from None
        self._cache: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()

    def compile(self, c: Constraint):
        """The compiled (fresh) matcher of ``c``, cached; ``ConstraintError`` with the library's
        message when the schema, regex or grammar is invalid."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
        llg = _llguidance()
        try:
            text = grammar_text(c)
        except ValueError as e:
            raise ConstraintError(str(e)) from None
        proto = llg.LLMatcher(self.tokenizer, text, log_level=0)
        if proto.is_error():
            raise ConstraintError(proto.get_error())
        with self._lock:
            self._cache[c] = proto
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return proto

    def matcher(self, c: Constraint) -> Matcher:
        """A new request's matcher (a copy of the cached compiled grammar)."""
        return Matcher(self.compile(c).deep_copy(), self.vocab, self.eos_ids)


def fill_rows(allow: np.ndarray, matchers: dict[int, Matcher]) -> bool:
    """Rows ``allow [slots, words]``: each constrained row its matcher's mask, the rest all ones.
    Returns whether any row is constrained."""
    allow[:] = ALL_ONES
    for row, m in matchers.items():
        m.fill(allow[row])
    return bool(matchers)

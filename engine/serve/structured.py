"""OpenAI's structured-output fields: ``response_format``, ``logit_bias``, ``tools`` / ``tool_choice``.

Parsed from the decoded JSON body into a ``Structured`` (what constrains each choice, how to
render and read tool calls). The grammar work itself is ``aotlm.generate.constraints``.

Tool calls: the tools go to the chat template (``tools=``, as HF templates take them). With
``tool_choice`` ``"required"`` the output is constrained to one call object
``{"name": ..., "arguments": {...}}`` of one of the tools (its arguments to that tool's
``parameters`` schema); with a named function to that function's ``parameters`` schema; with
``"auto"`` the model writes what it likes and a call in its text (a JSON call object, bare or
in ``<tool_call>`` tags as Hermes / Qwen templates write them) becomes ``message.tool_calls``;
``"none"`` renders no tools. One call per choice when constrained, and with ``parallel_tool_calls: false``.

Closed objects: a tool's ``parameters`` and a ``json_schema`` response format are read as OpenAI's
strict mode and xgrammar's strict mode (vLLM's default) read them: an object that does not say
``additionalProperties`` takes no keys besides its ``properties`` (``constraints.close_objects``),
so a weak model cannot wander into invented keys until ``max_tokens`` runs out. A tool's
``function.strict: false`` or a schema's ``strict: false`` keeps JSON Schema's letter; so does the
server's ``--lenient-schemas`` for requests that do not say. An answer cut by ``max_tokens`` is
never presented as a tool call: it comes back as ``content`` with ``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from aotlm.core.sampling import MAX_LOGIT_BIAS
from aotlm.generate.constraints import Constraint, ConstraintError, close_objects, from_response_format

TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class FieldError(ValueError):
    """A malformed structured-output field; ``param`` names it (HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Structured:
    """What a request asks of its output's form."""

    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    tools: tuple[dict, ...] = ()  # OpenAI tool objects, rendered into the prompt
    tool_choice: str = "none"  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named tool_choice
    names: tuple[str, ...] = field(default=())
    parallel: bool = True  # parallel_tool_calls: false reads at most one call from an answer

    @property
    def reads_calls(self) -> bool:
        """The answer is read for tool calls (its text is held back while streaming)."""
        return self.tool_choice in ("auto", "required", "named")


def logit_bias(v) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` (ids as strings, as JSON keys are) -> ``((id, bias), ...)``."""
    if v is None:
        return ()
    p = "logit_bias"
    if not isinstance(v, dict):
        raise FieldError("'logit_bias' must be an object mapping token ids to biases", p)
    if len(v) > MAX_LOGIT_BIAS:
        raise FieldError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}", p)
    out = []
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            raise FieldError(f"'logit_bias' keys must be token ids, got {k!r}", p) from None
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise FieldError(f"'logit_bias' values must be numbers in [-100, 100], got {b!r} for {k}", p)
        out.append((t, float(b)))
    return tuple(out)


def _tools(v) -> tuple[dict, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise FieldError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise FieldError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise FieldError(f"tools[{i}].function.strict must be true or false", "tools")
    return tuple(v)


def _params(tool: dict, closed: bool) -> dict:
    """A tool's ``parameters`` schema, its objects closed unless its ``strict`` says false (or it does
    not say and ``closed`` is False)."""
    schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    strict = tool["function"].get("strict")
    return close_objects(schema) if (closed if strict is None else strict) else schema


def parse(body: dict, chat: bool, closed: bool = True) -> Structured:
    """The structured-output fields of a request body (``chat``: tools are allowed). ``closed``:
    how schemas that do not say ``strict`` read objects without ``additionalProperties`` (see above)."""
    bias = logit_bias(body.get("logit_bias"))
    for name in ("functions", "function_call"):
        if body.get(name):
            raise FieldError(f"'{name}' (deprecated) is not supported: use 'tools' and 'tool_choice'", name)
    tools = _tools(body.get("tools"))
    if tools and not chat:
        raise FieldError("'tools' need /v1/chat/completions", "tools")
    try:
        fmt = from_response_format(body.get("response_format"), closed)
    except ConstraintError as e:
        raise FieldError(str(e), "response_format") from None
    choice, named = _tool_choice(body.get("tool_choice"), tools)
    names = tuple(t["function"]["name"] for t in tools)
    if choice in ("required", "named") and fmt is not None:
        raise FieldError("'response_format' cannot be combined with a forced tool call", "response_format")
    if choice == "named":
        tool = next(t for t in tools if t["function"]["name"] == named)
        fmt = Constraint.json_schema(_params(tool, closed), closed=False)
    elif choice == "required":
        fmt = Constraint.json_schema({"anyOf": [_call_schema(t, closed) for t in tools]}, closed=False)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        why = f"'parallel_tool_calls' must be true or false, got {parallel!r}"
        raise FieldError(why, "parallel_tool_calls")
    tools = tools if choice != "none" else ()
    return Structured(fmt, bias, tools, choice, named, names, parallel is not False)


def _call_schema(tool: dict, closed: bool) -> dict:
    name = tool["function"]["name"]
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _params(tool, closed)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tool_choice(v, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    p = "tool_choice"
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("none", "auto", "required"):
        if v != "none" and not tools:
            raise FieldError(f"'tool_choice' {v!r} needs 'tools'", p)
        return v, None
    fn = v.get("function") if isinstance(v, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldError(
            "'tool_choice' must be none, auto, required or {'type': 'function', 'function': {'name'}}", p
        )
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise FieldError(f"'tool_choice' names {fn['name']!r}, which is not in 'tools'", p)
    return "named", fn["name"]


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def read_calls(s: Structured, text: str, finish_reason: str | None = None) -> list[dict]:
    """The tool calls in an answer's ``text`` (empty: it is a plain answer, or one cut short by its
    token budget, ``finish_reason == "length"``, whose call would be partial)."""
    if finish_reason == "length":
        return []
    if s.tool_choice == "named":
        return [_call(s.named or "", text)]
    candidates = [m.group(1) for m in TOOL_TAG.finditer(text)] or [text.strip()]
    calls = []
    for c in candidates:
        try:
            obj = json.loads(c)
        except json.JSONDecodeError:
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict) or item.get("name") not in s.names:
                continue
            args = item.get("arguments", item.get("parameters", {}))
            calls.append(_call(item["name"], args))
    return calls if s.parallel else calls[:1]

"""Constrained decoding in the embedded engine: forced tool calls and JSON output, through llguidance.

What a request can constrain (OpenAI's fields, as vLLM's guided decoding serves them):
- `tool_choice` naming a function, or `"required"`: the completion is a tool call in the Hermes format
  the chat template renders (`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, then EOS),
  its arguments valid under the tool's `parameters` schema. A named choice makes exactly one call;
  `required` makes one call of any listed tool, or several (one per line, as the template joins them)
  unless `parallel_tool_calls` is false.
- `response_format` `{"type": "json_schema", ...}` or `{"type": "json_object"}`: the completion is one
  JSON value under the schema (any object for `json_object`), then EOS.
JSON is written the way the template's `tojson` writes it (`", "` and `": "`, no other whitespace), and
objects that do not say `additionalProperties` get no properties beyond the ones they list (what
xgrammar's strict mode, vLLM's default, does): a closed format keeps every constrained completion short
and parseable whatever the policy's weights.

The engine asks for a grammar per request (`GrammarCompiler.start`: one compiled matcher per grammar,
cached, deep-copied per sequence), fills each constrained row's allowed-token bitmask before a draw
(`fill_bitmasks`) and advances the row's matcher with the token drawn (`advance`). The grammar decides
where a constrained completion ends: it finishes with "stop" once the grammar is complete and EOS was
drawn, and `min_tokens` / `ignore_eos` do not apply to it. Logprobs stay the raw policy's (`_sampling.py`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "Constraint",
    "ConstraintError",
    "GrammarCompiler",
    "advance",
    "build_constraint",
    "fill_bitmasks",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


class ConstraintError(ValueError):
    """A constraint that cannot be served; `param` names the request field (the server answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """What a completion must look like; hashable, so compiled grammars are cached by it."""

    kind: Literal["tool_call", "json"]
    schemas: tuple[tuple[str, str], ...]
    """tool_call: (function name, arguments schema as JSON text) per allowed tool; json: (("", schema),)."""
    parallel: bool = False
    """tool_call: allow several calls in one completion."""
    param: str = "tool_choice"
    """The request field that asked for it (named in errors)."""


def _close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema without `additionalProperties` gets `false`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close_objects(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_ONE, "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _close_objects(out[key])
    return out


def _schema_text(schema: Any, param: str) -> str:
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ConstraintError(
            f"{param}: the JSON schema must be an object, got {type(schema).__name__}", param
        )
    return json.dumps(_close_objects(schema))  # key order kept: properties are generated in it


def _tool_schemas(tools: list[dict[str, Any]] | None, names: list[str] | None) -> tuple[tuple[str, str], ...]:
    """(name, arguments schema) of the tools a forced call may use: all of them, or those named."""
    by_name: dict[str, Any] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") or {}
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ConstraintError(
                f"tools.{i}.function.name: {name!r} must be 1-64 letters, digits, '_', '-' or '.' "
                "to be forced by tool_choice",
                f"tools.{i}.function.name",
            )
        by_name[name] = function.get("parameters")
    for name in names or []:
        if name not in by_name:
            raise ConstraintError(
                f"tool_choice: names the function {name!r}, which is not in tools {sorted(by_name)}",
                "tool_choice",
            )
    chosen = names or list(by_name)
    return tuple((name, _schema_text(by_name[name], "tools")) for name in chosen)


def build_constraint(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    response_format: dict[str, Any] | None,
    parallel_tool_calls: bool | None = None,
) -> Constraint | None:
    """The constraint a chat request asks for, or None (`tool_choice` auto/none and text output).

    `tool_choice`: "auto", "none", "required", None, or `{"type": "function", "function": {"name"}}`.
    A forced tool call wins over `response_format` (the completion is the call). Raises ConstraintError.
    """
    if isinstance(tool_choice, dict) or tool_choice == "required":
        if not tools:
            raise ConstraintError(
                "tool_choice: forcing a tool call needs a non-empty `tools` list", "tool_choice"
            )
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if not isinstance(name, str):
                raise ConstraintError("tool_choice.function.name: must be the name of a tool", "tool_choice")
            return Constraint("tool_call", _tool_schemas(tools, [name]))
        return Constraint("tool_call", _tool_schemas(tools, None), parallel=parallel_tool_calls is not False)
    if not response_format or response_format.get("type") in (None, "text"):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return Constraint("json", (("", json.dumps({"type": "object"})),), param="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ConstraintError(
                "response_format.json_schema.schema: a json_schema response format needs its JSON schema "
                'as {"json_schema": {"name": ..., "schema": {...}}}',
                "response_format",
            )
        return Constraint(
            "json", (("", _schema_text(spec["schema"], "response_format")),), param="response_format"
        )
    raise ConstraintError(
        f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
        "response_format",
    )


def _lark_json(schema_text: str) -> str:
    schema = json.loads(schema_text)
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


def _lark_grammar(constraint: Constraint, marker: dict[str, str]) -> str:
    """The llguidance Lark grammar of a constraint; `marker` spells the tool-call tags (token refs)."""
    if constraint.kind == "json":
        return "start: " + _lark_json(constraint.schemas[0][1])
    rules, alternatives = [], []
    for i, (name, schema_text) in enumerate(constraint.schemas):
        head = json.dumps('\n{"name": "' + name + '", "arguments": ')
        tail = json.dumps("}\n")
        rules.append(f"call_{i}: {marker['open']} {head} args_{i} {tail} {marker['close']}")
        rules.append(f"args_{i}: {_lark_json(schema_text)}")
        alternatives.append(f"call_{i}")
    repeat = ' ("\\n" call)*' if constraint.parallel else ""
    return "\n".join([f"start: call{repeat}", "call: " + " | ".join(alternatives), *rules])


class GrammarCompiler:
    """Compiles constraints for one tokenizer; one matcher per grammar is kept and copied per sequence."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], cache_size: int = 256
    ) -> None:
        """A constrained completion ends with the tokenizer's EOS, the token the chat template closes a
        turn with (`<|im_end|>`), not another of the model's EOS ids (`<|endoftext|>`)."""
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end)
        self.eos_token_ids = {end}
        self._marker = {
            "open": self._tag(tokenizer, TOOL_CALL_OPEN),
            "close": self._tag(tokenizer, TOOL_CALL_CLOSE),
        }
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @staticmethod
    def _tag(tokenizer: Any, text: str) -> str:
        """A tag that is one token in the vocabulary is referenced by id (special tokens never match
        text); otherwise it is spelled out."""
        token_id = tokenizer.get_vocab().get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    def start(self, constraint: Constraint, n: int) -> list[Any]:
        """`n` fresh matchers for `constraint` (ConstraintError naming its field if it cannot compile)."""
        with self._lock:
            template = self._compiled.get(constraint)
            if template is None:
                grammar = self._llg.LLMatcher.grammar_from_lark(_lark_grammar(constraint, self._marker))
                template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
                if template.is_error():
                    raise ConstraintError(
                        f"{constraint.param}: the JSON schema cannot be served: {template.get_error()}",
                        constraint.param,
                    )
                self._compiled[constraint] = template
                if len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint)
            return [template.deep_copy() for _ in range(n)]


def fill_bitmasks(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """(k, ceil(V / 32)) int32 allowed-token bitmasks, one row per matcher (CPU)."""
    words = (vocab_size + 31) // 32
    masks = torch.empty((len(matchers), words), dtype=torch.int32)
    for row, matcher in zip(masks, matchers, strict=True):
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    return masks


def advance(matcher: Any, token_id: int, eos_token_ids: set[int]) -> str | None:
    """Feed the drawn token to the row's matcher; the finish reason it implies, if any.

    "stop": the grammar is complete and EOS was drawn. "abort": the token was outside the grammar,
    which the mask rules out (a bug, reported rather than trained on as if it were valid).
    """
    if not matcher.consume_token(token_id):
        return "abort"
    if matcher.is_stopped() and token_id in eos_token_ids:
        return "stop"
    return None

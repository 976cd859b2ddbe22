"""The agent's tools: a calculator and a small key-value store, with their OpenAI `tools` schemas.

`ToolBox` runs one OpenAI tool call (name + JSON arguments string) and always returns text for a `tool`
message: a result, or `error: ...` when the call names no tool, its arguments are not a JSON object, or the
tool raises. A bad call therefore costs the agent one turn, never the episode, and the policy can read
what went wrong. The store is per episode: a value set in one call is what a later call reads.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_LENGTH = 200


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // %, parentheses) as text.

    Parsed with `ast`, never `eval`, so a policy cannot run code through it. Integral results print
    without a decimal point ("851", not "851.0"). Raises ValueError on anything else, ZeroDivisionError
    on a division by zero.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}") from exc
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


class KeyValueStore:
    """A dict the agent reads and writes through tools; one per episode, seeded from the task."""

    def __init__(self, initial: Mapping[str, str] | None = None) -> None:
        self.data: dict[str, str] = {str(k): str(v) for k, v in (initial or {}).items()}

    def get(self, key: str) -> str:
        """The value under `key`; LookupError (naming the keys there are) when it is missing."""
        if key not in self.data:
            raise LookupError(f"no key {key!r}; keys: {sorted(self.data)}")
        return self.data[key]

    def set(self, key: str, value: str) -> str:
        self.data[str(key)] = str(value)
        return "ok"


def _function(name: str, description: str, *params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        },
    }


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _function("calculator", "Arithmetic.", "expression"),
    _function("kv_get", "Read a key.", "key"),
    _function("kv_set", "Write a key.", "key", "value"),
]
"""What the flow sends as `tools=`. Every prompt carries them, so they are kept short: the tiny model's
prompt is mostly the chat template's tool preamble, and its length is most of the cost of a step on CPU."""


class ToolBox:
    """The tools of one episode. `call(name, arguments)` -> the text of the `tool` message."""

    def __init__(self, store: Mapping[str, str] | None = None) -> None:
        self.store = KeyValueStore(store)
        self.tools: dict[str, Callable[..., str]] = {
            "calculator": calculate,
            "kv_get": self.store.get,
            "kv_set": self.store.set,
        }

    def call(self, name: str, arguments: str | Mapping[str, Any] | None) -> tuple[str, bool]:
        """(observation, ok): the tool's result, or `error: ...` naming what was wrong."""
        if name not in self.tools:
            return f"error: unknown tool {name!r}; tools: {sorted(self.tools)}", False
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
        except json.JSONDecodeError as exc:
            return f"error: arguments of {name} are not valid JSON: {exc}", False
        if not isinstance(args, dict):
            return f"error: arguments of {name} must be a JSON object, got {type(args).__name__}", False
        try:
            return str(self.tools[name](**args)), True
        except TypeError as exc:  # missing or unexpected argument names
            return f"error: bad arguments for {name}: {exc}", False
        except Exception as exc:  # noqa: BLE001 - a raising tool is an observation, not a crash
            return f"error: {name} raised {type(exc).__name__}: {exc}", False

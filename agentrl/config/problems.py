"""Turn raw failures (pydantic errors, unknown override keys) into messages that name the dotted key.

Users type keys on the command line, so a message must say which key was wrong, what it got, what is
allowed, and for a misspelling the closest valid key (`did you mean actor_rollout_ref.model?`).
"""

from __future__ import annotations

import difflib
from functools import cache
from typing import Any

from pydantic import BaseModel, ValidationError

from agentrl.config.schema import AgentRLConfig


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


@cache
def schema_keys(model: type[BaseModel] = AgentRLConfig) -> tuple[str, ...]:
    """Every dotted key of the schema, sections included (`trainer`, `trainer.seed`, ...), in declaration order."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        keys.append(name)
        sub = _submodel(field.annotation)
        if sub is not None:
            keys.extend(f"{name}.{k}" for k in schema_keys(sub))
    return tuple(keys)


def leaf_keys(model: type[BaseModel] = AgentRLConfig) -> list[str]:
    """Dotted keys that hold values (not sections)."""
    return [k for k in schema_keys(model) if _model_at(k) is None]


def _model_at(dotted: str) -> type[BaseModel] | None:
    """The model class a section key points to; None for a value key (or an unknown one)."""
    model: type[BaseModel] | None = AgentRLConfig
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        model = _submodel(model.model_fields[part].annotation)
    return model


def describe_unknown_key(dotted: str) -> str:
    """Message for a key the schema lacks: which segment is wrong and the closest valid key."""
    parts = dotted.split(".")
    model: type[BaseModel] = AgentRLConfig
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        names = list(model.model_fields)
        if part in names:
            sub = _submodel(model.model_fields[part].annotation)
            if sub is None:  # a value key with more segments after it
                return f"unknown key {dotted}: {'.'.join(parts[: i + 1])} is a value, not a section"
            model = sub
            continue
        where = f"a key of {parent}" if parent else "a top-level section"
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        if close:
            guess = ".".join([*parts[:i], close[0], *parts[i + 1 :]])
            if guess not in schema_keys():  # the rest of the path is wrong too: suggest the section
                guess = ".".join([*parts[:i], close[0]])
            return f"unknown key {dotted}: {part!r} is not {where}; did you mean {guess}?"
        return f"unknown key {dotted}: {part!r} is not {where}; valid keys there: {', '.join(names)}"
    return f"unknown key {dotted}"


def _split_loc(loc: tuple[Any, ...]) -> tuple[str, str]:
    """Split a pydantic error location into (schema key, detail such as a list index or union branch)."""
    model: type[BaseModel] | None = AgentRLConfig
    key: list[str] = []
    rest = list(loc)
    while rest and model is not None and isinstance(rest[0], str) and rest[0] in model.model_fields:
        name = rest.pop(0)
        key.append(name)
        model = _submodel(model.model_fields[name].annotation)
    if rest and model is not None and isinstance(rest[0], str):  # unknown key inside a section
        key.append(rest.pop(0))
    detail = "".join(f"[{r}]" for r in rest if isinstance(r, int))
    return ".".join(key), detail


def _describe(error: dict[str, Any]) -> str:
    """Pydantic's message without its `Value error, ` prefix, lower-cased to follow `is invalid:`."""
    text = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    return text[:1].lower() + text[1:]


def _format_one(key: str, detail: str, errors: list[dict[str, Any]]) -> str:
    first = errors[0]
    if first["type"] == "extra_forbidden":
        return describe_unknown_key(key)
    if first["type"] == "missing":
        return f"missing key {key}: add it to the config (see docs/configuration.md)"
    got = first.get("input")
    allowed = " or ".join(dict.fromkeys(_describe(e) for e in errors))
    text = f"{key}{detail}={got!r} is invalid: {allowed}"
    expected = first.get("ctx", {}).get("expected")
    if first["type"] == "literal_error" and isinstance(got, str) and expected:
        choices = [c.strip().strip("'") for c in expected.replace(" or ", ", ").split(",")]
        close = difflib.get_close_matches(got, choices, n=1, cutoff=0.5)
        if close:
            text += f" (did you mean {close[0]!r}?)"
    return text


def format_validation_errors(exc: ValidationError) -> list[str]:
    """One message per bad key (union branches of one key are merged), in the order pydantic found them."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for error in exc.errors():
        key, detail = _split_loc(tuple(error["loc"]))
        grouped.setdefault((key, detail), []).append(error)
    return [_format_one(key, detail, errors) for (key, detail), errors in grouped.items()]

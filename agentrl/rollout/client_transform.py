"""A faster request transform for the `openai` calls that flows make while the collector runs them.

openai-python passes every request body through `async_maybe_transform`, which walks the body against the
request's TypedDicts and tries every member of every union (a chat message is a union of six, its content another
union): about 3 ms for an 8-turn history on one core, three quarters of a whole client call
(`benchmarks/client_transform.py`). An agent step of 128 episodes x 8 turns pays it 1,024 times on the event loop
that also runs the gateway and the server, while the engine's thread waits for the GIL.

That walk changes a body only where the request type declares an alias or a format (chat and completion requests
declare none: checked once per type, from its annotations), where a value is omitted (`omit`, `NOT_GIVEN`), where a
sequence is not a list, or where a value is a pydantic model. A body made only of dicts with string keys, lists,
strings, numbers, booleans and None therefore comes out equal to what went in; for such a body the fast path
returns it with its omitted top-level values dropped, and any other body goes through openai's own walk.

It is installed in openai's chat and completion resource modules (`install_fast_transform`) and takes effect only
inside `fast_transform()`, which the collector enters around each flow: other clients in the process keep
openai's behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any, get_args

logger = logging.getLogger(__name__)

_ACTIVE: ContextVar[bool] = ContextVar("agentrl_fast_transform", default=False)
_INSTALLED_MARK = "_agentrl_fast_transform"


@contextlib.contextmanager
def fast_transform() -> Iterator[None]:
    """Calls made in this context (and in tasks it starts) take the fast path for plain bodies."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def is_plain_json(value: Any) -> bool:
    """Only dicts with string keys, lists, str, int, float, bool and None (exact types, no subclasses)."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return True
    if kind is list:
        return all(is_plain_json(item) for item in value)
    if kind is dict:
        return all(type(key) is str and is_plain_json(item) for key, item in value.items())
    return False


@functools.lru_cache(maxsize=64)
def declares_no_rewrite(request_type: Any) -> bool:
    """True when nothing in `request_type`'s annotations is an alias or a format (`PropertyInfo`), so openai's
    walk leaves plain values as they are."""
    from openai._utils import is_typeddict
    from openai._utils._transform import PropertyInfo, get_type_hints

    seen: set[int] = set()
    pending = [request_type]
    while pending:
        annotation = pending.pop()
        if id(annotation) in seen or isinstance(annotation, (str, int, bool, type(None))):
            continue
        seen.add(id(annotation))
        for meta in getattr(annotation, "__metadata__", ()):
            if isinstance(meta, PropertyInfo) and (meta.alias or meta.format):
                return False
        if is_typeddict(annotation):
            pending.extend(get_type_hints(annotation, include_extras=True).values())
        else:
            pending.extend(get_args(annotation))
    return True


def fast_path_body(data: Any, request_type: Any) -> dict[str, Any] | None:
    """The body openai's walk would produce, when it is known without the walk; else None."""
    from openai._utils import is_given

    if type(data) is not dict or not declares_no_rewrite(request_type):
        return None
    body = {key: value for key, value in data.items() if is_given(value)}
    if not is_plain_json(body):
        return None
    return body


def _with_fast_path(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(original)
    async def transform(data: Any, expected_type: Any) -> Any:
        if _ACTIVE.get() and (body := fast_path_body(data, expected_type)) is not None:
            return body
        return await original(data, expected_type)

    setattr(transform, _INSTALLED_MARK, True)
    return transform


def install_fast_transform() -> bool:
    """Wrap `async_maybe_transform` where openai's async chat and completion resources call it (once per process).
    False, and openai untouched, where this openai version keeps it elsewhere."""
    import openai.resources.chat.completions.completions as chat_module
    import openai.resources.completions as completions_module

    installed = True
    for module in (chat_module, completions_module):
        original = getattr(module, "async_maybe_transform", None)
        if original is None:
            logger.debug(
                "openai: no async_maybe_transform in %s; requests take openai's walk", module.__name__
            )
            installed = False
        elif not getattr(original, _INSTALLED_MARK, False):
            module.async_maybe_transform = _with_fast_path(original)
    return installed

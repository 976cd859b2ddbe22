"""torch.compile caches kept across runs: one folder per model and toolchain, reused by a second process."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen2Config

from agentrl.models.compile_cache import compile_cache_dir, compile_cache_key, use_compile_cache

CPU = torch.device("cpu")


def test_the_key_changes_with_the_model_shape_and_dtype_but_not_with_its_name():
    base = compile_cache_key(Qwen2Config(hidden_size=64), torch.float32, CPU)
    assert compile_cache_key(Qwen2Config(hidden_size=64), torch.float32, CPU) == base
    renamed = Qwen2Config(hidden_size=64)
    renamed._name_or_path = "/some/other/folder"
    assert compile_cache_key(renamed, torch.float32, CPU) == base
    assert compile_cache_key(Qwen2Config(hidden_size=128), torch.float32, CPU) != base
    assert compile_cache_key(Qwen2Config(hidden_size=64, num_hidden_layers=3), torch.float32, CPU) != base
    assert compile_cache_key(Qwen2Config(hidden_size=64), torch.bfloat16, CPU) != base


def test_the_caches_go_to_the_models_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "AGENTRL_COMPILE_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    config = Qwen2Config(hidden_size=64)
    folder = use_compile_cache(config, torch.float32, CPU)
    assert folder == compile_cache_dir(config, torch.float32, CPU) and folder.parent == tmp_path / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    other = use_compile_cache(
        Qwen2Config(hidden_size=128), torch.float32, CPU
    )  # a second model: its own folder
    assert other != folder and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(other)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache(config, torch.float32, CPU) is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


PROGRAM = textwrap.dedent(
    """
    import torch
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config
    from agentrl.models.compile_cache import use_compile_cache

    use_compile_cache(Qwen2Config(hidden_size=64), torch.float32, torch.device("cpu"))
    step = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)
    step(torch.randn(8, 8))
    print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
    """
)


@pytest.mark.slow
def test_a_second_process_reuses_the_first_ones_compiled_graph(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.pop("AGENTRL_COMPILE_CACHE_DIR", None)
    env["AGENTRL_CACHE"] = str(tmp_path)

    def run() -> str:
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    assert run() == "hits 0 misses 1"
    assert run() == "hits 1 misses 0"
    assert len(list((tmp_path / "compile").iterdir())) == 1


def test_a_start_without_bytecode_for_torch_is_named_with_its_fix(tmp_path):
    import importlib.util
    import py_compile

    from agentrl.models.compile_cache import uncached_bytecode_warning

    module = tmp_path / "big_module.py"
    module.write_text("x = 1\n")
    warning = uncached_bytecode_warning(str(module), dont_write=True)
    assert warning is not None
    assert str(module) in warning and "PYTHONDONTWRITEBYTECODE" in warning
    assert f"python -m compileall -q -j 0 {tmp_path}" in warning
    assert uncached_bytecode_warning(str(module), dont_write=False) is None  # this process would write it
    if os.geteuid() != 0:  # root writes anywhere
        tmp_path.chmod(0o555)
        try:
            assert "not writable" in uncached_bytecode_warning(str(module), dont_write=False)
        finally:
            tmp_path.chmod(0o755)
    py_compile.compile(str(module), cfile=importlib.util.cache_from_source(str(module)))
    assert uncached_bytecode_warning(str(module), dont_write=True) is None

"""The `agentrl` command: help, lazy subcommands, `agentrl config` output and exit statuses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from agentrl import cli

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "agentrl.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)


def test_misspelt_key_exits_nonzero_naming_it_and_the_fix():
    result = _run("config", "actor_rollout_ref.modle.path=x")
    assert result.returncode == 2
    assert "'modle' is not a key of actor_rollout_ref" in result.stderr
    assert "did you mean actor_rollout_ref.model.path?" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_console_script_prints_resolved_config():
    script = Path(sys.executable).parent / "agentrl"
    if not script.exists():
        pytest.skip("agentrl console script not installed next to this interpreter")
    result = subprocess.run(
        [str(script), "config", "actor_rollout_ref.model.lora_rank=8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "    lora_rank: 8\n" in result.stdout
    printed = yaml.safe_load(result.stdout)
    assert printed["actor_rollout_ref"]["model"]["lora_rank"] == 8
    assert printed["actor_rollout_ref"]["rollout"]["max_model_len"] == 320  # derived values are resolved


def test_config_command_does_not_import_torch():
    code = "import sys; from agentrl.cli import main; rc = main(['config']); assert 'torch' not in sys.modules; sys.exit(rc)"
    result = _run(code=code)
    assert result.returncode == 0, result.stderr


def test_config_in_process_with_config_file(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text("defaults:\n  - agent_ppo_trainer\n  - _self_\ntrainer:\n  total_epochs: 4\n")
    assert cli.main(["config", "-c", str(path), "trainer.seed=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["trainer"]["total_epochs"], printed["trainer"]["seed"]) == (4, 9)


def test_config_errors_list_every_problem(capsys):
    assert cli.main(["config", "actor_rollout_ref.rollout.n=1", "trainer.resume_mode=resume_path"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (2 problems)" in err
    assert "actor_rollout_ref.rollout.n=1" in err and "trainer.resume_from_path" in err


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("config", "train", "sft", "serve"):
        assert f"\n  {name} " in out


def test_no_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: agentrl <command>" in capsys.readouterr().err


def test_unknown_command_suggests_closest(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err


@pytest.fixture
def commands(monkeypatch, tmp_path):
    """Point COMMANDS at throwaway modules written to tmp_path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    table = dict(cli.COMMANDS)
    monkeypatch.setattr(cli, "COMMANDS", table)

    def _add(name: str, target: str, source: str | None = None) -> None:
        if source is not None:
            (tmp_path / f"{target.split(':')[0]}.py").write_text(textwrap.dedent(source))
        table[name] = cli.Command(target, "test command")

    return _add


def test_missing_module_is_a_clear_error_not_a_traceback(commands, capsys):
    commands("ghost", "agentrl_cli_test_absent_module:main")
    assert cli.main(["ghost"]) == 1
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "agentrl ghost: not available in this installation (module agentrl_cli_test_absent_module not found)"
    )


def test_missing_dependency_names_it(commands, capsys):
    commands("dep", "agentrl_cli_test_dep:main", "import agentrl_cli_test_no_such_dependency\n")
    assert cli.main(["dep"]) == 1
    assert "cannot import agentrl_cli_test_dep: No module named 'agentrl_cli_test_no_such_dependency'" in (
        capsys.readouterr().err
    )


def test_missing_function_is_named(commands, capsys):
    commands("nofn", "agentrl_cli_test_nofn:main", "x = 1\n")
    assert cli.main(["nofn"]) == 1
    assert "agentrl_cli_test_nofn has no function main" in capsys.readouterr().err


def test_subcommand_gets_remaining_args_and_its_status(commands, capsys):
    commands(
        "echo",
        "agentrl_cli_test_echo:run",
        """
        def run(argv):
            print("|".join(argv))
            return 3
        """,
    )
    assert cli.main(["echo", "a=1", "b=2"]) == 3
    assert capsys.readouterr().out == "a=1|b=2\n"


def test_config_error_from_any_subcommand_exits_2(commands, capsys):
    commands(
        "cfg",
        "agentrl_cli_test_cfg:run",
        """
        from agentrl.config import load_config

        def run(argv):
            load_config(argv)
        """,
    )
    assert cli.main(["cfg", "tranier.seed=1"]) == 2
    assert "did you mean trainer.seed?" in capsys.readouterr().err


# ---- as a user runs it: the console script, from their own folder --------------------------------------


def _agentrl(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "agentrl"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "agentrl.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, timeout=120, env=env)


@pytest.mark.parametrize(("command", "flag"), [("train", "--help"), ("sft", "-h")])
def test_train_and_sft_print_their_usage(tmp_path, command, flag):
    result = _agentrl(command, flag, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: agentrl {command} [-h] [-c PATH] [key=value ...]")
    assert "--config PATH" in result.stdout and "Hydra overrides" in result.stdout
    assert not any(tmp_path.iterdir())  # nothing ran


MY_MODULE = """
from agentrl import AgentFlow


class Solver(AgentFlow):
    async def run(self, task, ctx):
        return "4"


def exact(task, episode):
    return 1.0
"""


def test_a_flow_in_the_current_folder_imports(tmp_path):
    (tmp_path / "mymodule.py").write_text(MY_MODULE)
    result = _agentrl("config", "agent.flow=mymodule:Solver", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "flow: mymodule:Solver" in result.stdout


def test_config_refuses_a_flow_that_does_not_import(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
    result = _agentrl("config", "agent.flow=broken:Solver", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "agent.flow='broken:Solver': cannot import module 'broken': "
        "ModuleNotFoundError: No module named 'no_such_dependency_xyz'" in result.stderr
    )
    (tmp_path / "mymodule.py").write_text(MY_MODULE)
    result = _agentrl("config", "agent.flow=mymodule:Solvr", cwd=tmp_path)
    assert result.returncode == 2 and "has no 'Solvr'" in result.stderr


def test_a_plain_function_evaluator_is_refused_with_how_to_wrap_it(tmp_path):
    (tmp_path / "mymodule.py").write_text(MY_MODULE)
    result = _agentrl("train", "agent.evaluator=mymodule:exact", cwd=tmp_path)
    assert result.returncode == 2
    assert "agent.evaluator='mymodule:exact': evaluator must be an Evaluator" in result.stderr
    assert "decorate it with @agentrl.evaluator" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_names_an_empty_data_file(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    result = _agentrl(
        "train", "data.train_files=train.jsonl", f"trainer.default_local_dir={tmp_path}/o", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "train.jsonl: the dataset file has no rows" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_names_bad_device_and_model_path(tmp_path):
    result = _agentrl(
        "train", "actor_rollout_ref.model.path=/no/such/model", "trainer.device=cuda", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "actor_rollout_ref.model.path='/no/such/model': no such file or folder" in result.stderr
    assert "Traceback" not in result.stderr
    import torch

    if not torch.cuda.is_available():
        assert "trainer.device=cuda: this machine has no CUDA device" in result.stderr


def test_serve_start_up_errors_are_one_line_and_status_2(tmp_path):
    """A taken port is refused before any model is built or loaded (the model cache stays empty), naming --port;
    a model path that does not exist is refused the same way, like `agentrl train` refuses it."""
    env = {**os.environ, "AGENTRL_CACHE": str(tmp_path / "cache")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _agentrl("serve", "--model", "tiny:qwen2", "--port", str(port), cwd=tmp_path, env=env)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line == (
        f"agentrl serve: --port {port}: 127.0.0.1:{port} is already in use; pick another --port, "
        "or leave it out for a free one"
    )
    assert not (tmp_path / "cache").exists()  # checked before the tiny model was built
    result = _agentrl("serve", "--model", "/no/such/model", cwd=tmp_path, env=env)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("agentrl serve: --model='/no/such/model': no such file or folder")
    result = _agentrl("serve", "--model", "tiny:no-such-preset", cwd=tmp_path, env=env)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "unknown tiny preset 'no-such-preset'" in result.stderr


def test_serve_threads_default_to_the_usable_cores_and_zero_is_refused(tmp_path):
    from agentrl.cli.serve import _parse_args, engine_threads

    assert engine_threads() == len(os.sched_getaffinity(0))
    assert _parse_args(["--model", "tiny:qwen2", "--threads", "3"]).threads == 3
    assert _parse_args(["--model", "tiny:qwen2", "--max-num-seqs", "32"]).max_num_seqs == 32
    result = _agentrl("serve", "--model", "tiny:qwen2", "--threads", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--threads must be >= 1, got 0" in result.stderr


def test_serve_prefill_flags_reach_either_engine_as_given(tmp_path):
    """vLLM's flags: the embedded engine takes the ones given as its arguments, `vllm serve` gets them back as
    flags; none given leaves both engines' defaults. `--num-scheduler-steps` (vLLM V0's) is the embedded
    engine's alone."""
    from agentrl.cli.serve import _engine_options, _parse_args, _vllm_prefill_flags

    given = _parse_args(
        [
            "--model",
            "tiny:qwen2",
            "--no-enable-chunked-prefill",
            "--enable-prefix-caching",
            "--max-num-batched-tokens",
            "64",
            "--num-scheduler-steps",
            "4",
        ]
    )
    assert _engine_options(given) == {
        "enable_prefix_caching": True,
        "chunked_prefill": False,
        "prefill_chunk_tokens": 64,
        "num_scheduler_steps": 4,
    }
    assert _vllm_prefill_flags(given) == [
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "64",
    ]
    none = _parse_args(["--model", "tiny:qwen2"])
    assert _engine_options(none) == {} and _vllm_prefill_flags(none) == []
    result = _agentrl("serve", "--model", "tiny:qwen2", "--max-num-batched-tokens", "8", cwd=tmp_path)
    assert result.returncode == 2 and "--max-num-batched-tokens must be >= 16, got 8" in result.stderr
    result = _agentrl("serve", "--model", "tiny:qwen2", "--num-scheduler-steps", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--num-scheduler-steps must be >= 1, got 0" in result.stderr
    result = _agentrl("serve", "--model", "x", "--engine", "vllm", "--num-scheduler-steps", "2", cwd=tmp_path)
    assert result.returncode == 2 and "--num-scheduler-steps is the embedded engine's" in result.stderr

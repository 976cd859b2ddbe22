"""AgentTrainer checks everything it can before any model loads."""

import pytest
import torch

from agentrl import AgentTrainer, Evaluator, MathAnswerMatch, SingleTurnChatFlow, evaluator
from agentrl.config import ConfigError
from agentrl.data import DatasetError
from agentrl.models.loading import load_tokenizer, model_path_problem

ROW = {
    "data_source": "toy",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "reward_model": {"style": "rule", "ground_truth": "2"},
}


def test_offload_and_placement_without_the_ray_backend_are_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match="set trainer.backend=ray") as caught:
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=[ROW],
            config=[
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                "resource_pool_config.actor_rollout_gpus=1",
                f"trainer.default_local_dir={tmp_path}",
            ],
        )
    assert "resource_pool_config.actor_rollout_gpus=1" in str(caught.value)
    assert not any(tmp_path.iterdir())  # nothing was written


def test_flow_and_evaluator_types_are_checked():
    with pytest.raises(TypeError, match="flow must be an AgentFlow"):
        AgentTrainer(flow=lambda t, c: "x", evaluator=MathAnswerMatch(), train_dataset=[ROW])
    with pytest.raises(TypeError, match="evaluator must be an Evaluator"):
        AgentTrainer(flow=SingleTurnChatFlow(), evaluator=lambda t, e: 1.0, train_dataset=[ROW])


def test_settings_this_version_cannot_honour_are_refused_together(tmp_path):
    overrides = [
        "data.return_multi_modal_inputs=true",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
        "actor_rollout_ref.hybrid_engine=false",
        f"trainer.default_local_dir={tmp_path}",
    ]
    with pytest.raises(ConfigError) as caught:
        AgentTrainer(
            flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), train_dataset=[ROW], config=overrides
        )
    message = str(caught.value)
    assert "data.return_multi_modal_inputs=true with algorithm.adv_estimator=gae" in message
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true" in message
    assert "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16: on the local backend" in message
    assert "actor_rollout_ref.hybrid_engine=false" in message
    assert not any(tmp_path.iterdir())


def test_the_local_backend_takes_float32_master_weights_and_refuses_narrower_ones(tmp_path):
    key = "actor_rollout_ref.actor.fsdp_config.model_dtype"
    mixed = [
        "actor_rollout_ref.model.dtype=bfloat16",
        f"{key}=float32",
        f"trainer.default_local_dir={tmp_path}",
    ]
    AgentTrainer(flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), train_dataset=[ROW], config=mixed)
    narrower = [
        "actor_rollout_ref.model.dtype=float16",
        f"{key}=bfloat16",
        f"trainer.default_local_dir={tmp_path}",
    ]
    with pytest.raises(
        ConfigError, match=f"{key}=bfloat16: on the local backend the master weights are float32"
    ):
        AgentTrainer(
            flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), train_dataset=[ROW], config=narrower
        )


def _trainer(tmp_path, overrides=(), **kwargs):
    kwargs.setdefault("flow", SingleTurnChatFlow())
    kwargs.setdefault("evaluator", MathAnswerMatch())
    return AgentTrainer(config=[f"trainer.default_local_dir={tmp_path}", *overrides], **kwargs)


def test_an_empty_train_file_is_named(tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match=rf"{empty}: the dataset file has no rows"):
        _trainer(tmp_path, [f"data.train_files={empty}"])


def test_prompt_key_is_used_by_the_row_check(tmp_path):
    row = {**ROW, "question": ROW["prompt"]}
    del row["prompt"]
    trainer = _trainer(tmp_path, ["data.prompt_key=question"], train_dataset=[row], val_dataset=[row])
    assert trainer.train_rows[0]["question"] == ROW["prompt"]
    with pytest.raises(DatasetError, match="train_dataset: row 0: field 'prompt' is missing"):
        _trainer(tmp_path, train_dataset=[row])


def test_a_plain_function_evaluator_is_refused_with_how_to_wrap_it(tmp_path):
    def exact(task, episode):
        return 1.0

    with pytest.raises(TypeError, match=r"@agentrl.evaluator .*agentrl.evaluator\(exact\)"):
        _trainer(tmp_path, evaluator=exact, train_dataset=[ROW])
    with pytest.raises(TypeError, match=r"pass an instance, MathAnswerMatch\(\), not the class"):
        _trainer(tmp_path, evaluator=MathAnswerMatch, train_dataset=[ROW])
    wrapped = _trainer(tmp_path, evaluator=evaluator(exact), train_dataset=[ROW])
    assert isinstance(wrapped.evaluator, Evaluator)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="trainer.device=cuda: this machine has no CUDA device"):
        _trainer(tmp_path, ["trainer.device=cuda"], train_dataset=[ROW])


def test_a_model_path_that_names_nothing_is_a_config_error(tmp_path):
    missing = str(tmp_path / "models" / "qwen")
    with pytest.raises(
        ConfigError, match=rf"actor_rollout_ref.model.path='{missing}': no such file or folder"
    ):
        _trainer(tmp_path, [f"actor_rollout_ref.model.path={missing}"], train_dataset=[ROW])
    # Hub ids and existing folders pass the check (nothing is downloaded here).
    assert model_path_problem("Qwen/Qwen2.5-0.5B-Instruct", "k") is None
    assert model_path_problem("gpt2", "k") is None
    assert model_path_problem(str(tmp_path), "k") is None
    assert model_path_problem("./my-model", "k") is not None


def test_loading_a_missing_model_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_summary_lines_report_held_out_accuracy_only_when_measured(tmp_path):
    from agentrl.trainer import TrainResult

    done = TrainResult(
        run_dir=tmp_path,
        global_step=3,
        metrics={"val/accuracy": 0.5},
        initial_val_metrics={"val/accuracy": 0.25},
    )
    assert done.summary_lines() == [
        f"trained 3 steps; run folder {tmp_path}",
        "held-out accuracy 0.250 -> 0.500",
    ]
    assert TrainResult(run_dir=tmp_path, global_step=3).summary_lines() == [
        f"trained 3 steps; run folder {tmp_path}"
    ]

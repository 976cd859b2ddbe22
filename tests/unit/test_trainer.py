"""AgentTrainer checks everything it can before any model loads."""

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.config import ConfigError

ROW = {
    "data_source": "toy",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "reward_model": {"style": "rule", "ground_truth": "2"},
}


def test_an_unavailable_worker_backend_is_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match="trainer.backend=ray"):
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=MathAnswerMatch(),
            train_dataset=[ROW],
            config=["trainer.backend=ray", f"trainer.default_local_dir={tmp_path}"],
        )
    assert not any(tmp_path.iterdir())  # nothing was written


def test_flow_and_evaluator_types_are_checked():
    with pytest.raises(TypeError, match="flow must be an AgentFlow"):
        AgentTrainer(flow=lambda t, c: "x", evaluator=MathAnswerMatch(), train_dataset=[ROW])
    with pytest.raises(TypeError, match="evaluator must be an Evaluator"):
        AgentTrainer(flow=SingleTurnChatFlow(), evaluator=lambda t, e: 1.0, train_dataset=[ROW])


def test_settings_this_version_cannot_honour_are_refused_together(tmp_path):
    overrides = [
        "data.return_multi_modal_inputs=true",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.hybrid_engine=false",
        f"trainer.default_local_dir={tmp_path}",
    ]
    with pytest.raises(ConfigError) as caught:
        AgentTrainer(
            flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), train_dataset=[ROW], config=overrides
        )
    message = str(caught.value)
    assert "data.return_multi_modal_inputs=true" in message
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true" in message
    assert "actor_rollout_ref.hybrid_engine=false" in message
    assert not any(tmp_path.iterdir())

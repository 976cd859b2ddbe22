"""Training and validation sampling come from `actor_rollout_ref.rollout` as documented."""

from agentrl.config import load_config
from agentrl.rollout.stack import build_sampling_params


def test_rollout_keys_reach_training_sampling_and_validation_stays_greedy():
    config = load_config(
        [
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.rollout.top_p=0.9",
            "actor_rollout_ref.rollout.ignore_eos=true",
            "data.max_response_length=48",
            "trainer.seed=5",
        ]
    )
    train, validation = build_sampling_params(config)
    assert (train.temperature, train.top_p, train.max_tokens, train.seed) == (0.7, 0.9, 48, 5)
    assert train.ignore_eos is True
    assert validation.temperature == 0.0 and validation.ignore_eos is False  # held-out answers end at EOS
    assert build_sampling_params(load_config([]))[0].ignore_eos is False

"""The embedded rollout backend through `start_policy_serving`: URLs, pushes, fingerprint, and the probe
(the check vLLM needs) answered by the embedded server in the same shape, matching the trainer's log-probs."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import load_config
from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.rollout.engines.embedded import fingerprint_state_dict
from agentrl.rollout.serving import start_policy_serving
from agentrl.training.parallel.weight_sync import check_probe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    config = load_config(["actor_rollout_ref.model.path=tiny:qwen2-mini"])
    path = resolve_model_path(config.actor_rollout_ref.model.path)
    backend = start_policy_serving(path, load_tokenizer(path), config, device="cpu")
    try:
        yield backend, load_causal_lm(path)
    finally:
        backend.stop()


def test_push_then_fingerprint_and_probe_match_the_trainer(setup):
    backend, model = setup
    assert backend.urls == [backend.url] and backend.url.startswith("http://127.0.0.1:")
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # the trainer's weights move away from what is served
    prompt = [11, 12, 13, 14]
    with pytest.raises(RuntimeError, match="weight sync failed"):
        check_probe(model, prompt, backend.probe(prompt, 4), tolerance=1e-3)

    assert backend.push_weights(model.state_dict()) == 1
    assert backend.served_fingerprint() == fingerprint_state_dict(model.state_dict())
    [result] = backend.probe(prompt, 4)
    assert result.url == backend.url and len(result.token_ids) == len(result.logprobs) == 4
    assert check_probe(model, prompt, [result], tolerance=1e-3) < 1e-4


@pytest.mark.parametrize(
    ("overrides", "bound"),
    [
        ([], 0),
        (["async_training.enable=true", "async_training.staleness_threshold=2"], 0),
        (
            [
                "async_training.enable=true",
                "async_training.staleness_threshold=2",
                "async_training.reuse_stale_prefixes=true",
            ],
            2,
        ),
    ],
)
def test_the_engine_keeps_stale_prefixes_only_within_the_staleness_bound_when_asked(overrides, bound):
    config = load_config(["actor_rollout_ref.model.path=tiny:qwen2-mini", *overrides])
    path = resolve_model_path(config.actor_rollout_ref.model.path)
    backend = start_policy_serving(path, load_tokenizer(path), config, device="cpu")
    try:
        assert backend.engine.prefix_max_weight_changes == bound
    finally:
        backend.stop()

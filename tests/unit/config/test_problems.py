"""Key paths and unknown-key messages: the wrong segment is named and the closest valid key suggested."""

from __future__ import annotations

from agentrl.config.problems import describe_unknown_key, leaf_keys, schema_keys


def test_schema_keys_cover_sections_and_values():
    keys = schema_keys()
    assert "actor_rollout_ref" in keys and "actor_rollout_ref.model" in keys
    assert "actor_rollout_ref.model.lora_rank" in keys and "actor_rollout_ref.actor.optim.lr" in keys
    assert len(keys) == len(set(keys))
    leaves = leaf_keys()
    assert "actor_rollout_ref.model.lora_rank" in leaves and "actor_rollout_ref.model" not in leaves


def test_misspelt_middle_segment_suggests_full_key():
    message = describe_unknown_key("actor_rollout_ref.modle.path")
    assert "'modle' is not a key of actor_rollout_ref" in message
    assert message.endswith("did you mean actor_rollout_ref.model.path?")


def test_misspelt_leaf_and_section():
    assert describe_unknown_key("trainer.totl_epochs").endswith("did you mean trainer.total_epochs?")
    assert describe_unknown_key("algoritm.gamma").endswith("did you mean algorithm.gamma?")
    assert "is not a top-level section" in describe_unknown_key("algoritm.gamma")


def test_suggestion_falls_back_to_section_when_rest_is_wrong_too():
    message = describe_unknown_key("actor_rollout_ref.modle.pth")
    assert message.endswith("did you mean actor_rollout_ref.model?")


def test_no_close_match_lists_valid_keys():
    message = describe_unknown_key("agent.zzzz")
    assert "valid keys there: flow, evaluator, max_steps, n_parallel_tasks" in message


def test_value_used_as_section():
    assert "actor_rollout_ref.model.path is a value, not a section" in describe_unknown_key(
        "actor_rollout_ref.model.path.x"
    )

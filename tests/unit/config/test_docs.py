"""docs/configuration.md documents every schema key and matches what the generator writes."""

from __future__ import annotations

from pathlib import Path

from agentrl.config.docs import generate_markdown
from agentrl.config.problems import schema_keys

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_every_schema_key_is_documented():
    text = DOCS.read_text()
    missing = [key for key in schema_keys() if f"`{key}`" not in text]
    assert missing == [], f"undocumented keys (run `python -m agentrl.config.docs > {DOCS}`): {missing}"


def test_docs_are_up_to_date():
    assert DOCS.read_text() == generate_markdown(), (
        "docs/configuration.md is stale: run `python -m agentrl.config.docs > docs/configuration.md`"
    )


def test_generated_rows_show_type_default_and_description():
    text = generate_markdown()
    assert (
        "| `actor_rollout_ref.model.lora_rank` | int, >= 0 | `0` | LoRA rank; 0 trains all weights, "
        "> 0 trains (and syncs) only the adapters. |" in text
    )
    assert "| `critic.optim.lr` | float, > 0.0 | `1.0e-05` |" in text
    assert "`${agentrl.pkg:data/samples/gsm8k_train.jsonl}`" in text
    assert "- trainer.resume_mode=resume_path needs trainer.resume_from_path" in text

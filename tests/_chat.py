"""Prompt ids of one-question chats, as the tests' engines receive them."""

from typing import Any


def one_question_prompts(tokenizer: Any, questions: list[str]) -> list[list[int]]:
    """Each question as a user message, rendered by the tokenizer's chat template for generation."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]

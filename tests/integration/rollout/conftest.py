"""Shared fixtures of the embedded-engine tests: the tiny model with weights that make greedy text vary."""

import pytest
import torch

from agentrl.models import load_causal_lm, load_tokenizer
from tests._chat import one_question_prompts

MODEL = "tiny:qwen2-mini"
QUESTIONS = ["What is 2+3?", "Alice has 5 apples and buys 7 more. How many now?", "Hi", "Count: 1 2 3"]


def diverse_model(seed: int = 0):
    """The tiny preset with larger random weights, so greedy text varies (the stock init repeats '\\n')."""
    model = load_causal_lm(MODEL)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def model():
    return diverse_model()


@pytest.fixture(scope="module")
def make_diverse_model():
    """`diverse_model` itself, for tests that need other weights (another seed)."""
    return diverse_model


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Four one-question chats, rendered for generation: short prompts of different lengths."""
    return one_question_prompts(tokenizer, QUESTIONS)

"""A seeded random Qwen2 small enough for unit tests that need a real model but no preset folder."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def random_qwen2(vocab_size: int = 96, num_hidden_layers: int = 2, tied: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config).eval()

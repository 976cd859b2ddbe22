"""Model FLOPs and MFU (`perf/mfu/actor`), against numbers worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agentrl.training.flops import device_peak_flops, mfu, training_flops

# 2 layers, hidden 8, 2 heads of 4, 1 kv head, MLP 16, vocab 10.
CONFIG = SimpleNamespace(
    hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, intermediate_size=16,
    vocab_size=10,
)  # fmt: skip


def test_training_flops_counts_matmul_parameters_and_attention_pairs():
    """Per layer: q, k, v = 8 x 4 x (2 + 2 x 1) = 128, o = 2 x 4 x 8 = 64, MLP 3 x 8 x 16 = 384: 576.
    Matmul parameters: 2 x 576 + the head 10 x 8 = 1232. Sequences of 3 and 5 tokens: 8 tokens, 9 + 25 = 34
    pairs. FLOPs = 6 x 1232 x 8 + 12 x 2 layers x 2 heads x 4 x 34 = 59,136 + 6,528 = 65,664."""
    assert training_flops(CONFIG, [3, 5]) == 65_664


def test_a_vision_language_config_counts_its_text_model():
    assert training_flops(SimpleNamespace(text_config=CONFIG), [3, 5]) == 65_664


def test_mfu_is_flops_over_time_and_peak_and_absent_without_a_peak():
    """65,664 FLOPs in 2 s on a 65,664 FLOP/s device: 50 %."""
    assert mfu(CONFIG, [3, 5], 2.0, 65_664.0) == pytest.approx(0.5)
    assert mfu(CONFIG, [3, 5], 2.0, None) is None
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16) is None

"""LoRA on vision-language models: `all-linear` adapts the language model's linear layers, never the vision tower."""

import pytest
import torch

from agentrl.models import load_causal_lm
from agentrl.training.lora import apply_lora

_LANGUAGE_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("spec", ["tiny:qwen2-vl", "tiny:qwen3-vl"])
def test_all_linear_on_a_vision_language_model_adapts_only_the_language_model(spec):
    base = load_causal_lm(spec)
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    language = {n for n in linear if ".language_model." in n}
    assert linear - language  # the vision tower (and Qwen3-VL's deepstack mergers) has linear layers too
    model = apply_lora(base, rank=4, alpha=8, target_modules="all-linear")
    adapted = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == language
    assert {n.rsplit(".", 1)[1] for n in adapted} == _LANGUAGE_PROJECTIONS
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

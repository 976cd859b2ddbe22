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


def _adapter_input_dtypes(model) -> list[torch.dtype]:
    seen = []
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.lora_A["default"].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    return seen


def test_float32_adapters_on_a_bf16_base_compute_in_bf16_and_keep_float32_gradients():
    """peft keeps adapters in float32 and casts each adapted layer's input up to it; under
    `adapters_in_base_dtype` the inputs stay bf16 (autocast multiplies in bf16), gradients reach the float32
    adapters in float32, and the log-probs agree with the float32-adapter path to bf16's precision."""
    from agentrl.training.lora import adapters_in_base_dtype, low_precision_base_dtype

    model = apply_lora(
        load_causal_lm("tiny:qwen2", dtype="bfloat16"), rank=4, alpha=8, target_modules="all-linear"
    )
    assert low_precision_base_dtype(model) == torch.bfloat16
    for name, param in model.named_parameters():  # nonzero B, so the adapters change the output
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    ids = torch.randint(10, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    seen = _adapter_input_dtypes(model)

    plain = model(input_ids=ids).logits.float()
    assert set(seen) == {torch.float32}  # peft's own path: every adapter input copied to float32
    seen.clear()
    with adapters_in_base_dtype(model):
        mixed = model(input_ids=ids).logits.float()
    assert set(seen) == {torch.bfloat16} and len(seen) == 7 * model.config.num_hidden_layers
    assert (mixed - plain).abs().max() < 0.05 * plain.abs().max()
    mixed.logsumexp(-1).sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)

    seen.clear()
    model(input_ids=ids)  # outside the context peft's casting is back
    assert set(seen) == {torch.float32}
    full = load_causal_lm("tiny:qwen2", dtype="bfloat16")
    assert low_precision_base_dtype(full) is None  # not LoRA: nothing to do
    assert (
        low_precision_base_dtype(
            apply_lora(load_causal_lm("tiny:qwen2"), rank=4, alpha=8, target_modules="all-linear")
        )
        is None
    )

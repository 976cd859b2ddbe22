"""The weights the engine serves for a LoRA actor: each adapted weight merged as W + s B A, in either layout."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.pytorch_utils import Conv1D

from agentrl.training.parallel.served_weights import served_state_dict


class _TwoLayers(torch.nn.Module):
    """A Linear (weight out x in) and a GPT-2 style Conv1D (weight in x out: peft's fan_in_fan_out)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 3)
        self.conv = Conv1D(3, 5)  # 5 inputs, 3 outputs


@pytest.mark.parametrize("layer, fan_in_fan_out", [("linear", False), ("conv", True)])
def test_served_weight_is_the_base_plus_the_scaled_adapter_product_and_leaves_the_base(layer, fan_in_fan_out):
    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=6, target_modules=[layer], fan_in_fan_out=fan_in_fan_out)
    model = get_peft_model(_TwoLayers(), config)
    adapted = getattr(model.base_model.model, layer)
    with torch.no_grad():
        adapted.lora_B["default"].weight.normal_()  # peft starts B at zero: the merge would add nothing
    base = adapted.base_layer.weight.detach().clone()
    a, b = adapted.lora_A["default"].weight, adapted.lora_B["default"].weight
    update = (b @ a).detach() * 3.0  # scaling = alpha / r
    expected = base + (update.t() if fan_in_fan_out else update)

    served = served_state_dict(model)

    assert torch.allclose(served[f"{layer}.weight"], expected, atol=1e-6)
    assert (served[f"{layer}.weight"] - base).abs().max() > 0.1
    assert torch.equal(adapted.base_layer.weight, base)  # merged into a copy, never into the trainer's base


def _state_dict_names(model) -> dict[str, torch.Tensor]:
    """The served names as `state_dict()` gives them: adapter tensors left out, `.base_layer.` dropped."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_served_weights_have_the_state_dicts_names_order_and_tensors(lora):
    """The served walk skips peft's adapter modules but serves what `state_dict()` holds: every name in its
    order (a tied embedding under both names), the same tensors where nothing merges into them."""
    from agentrl.models import load_causal_lm

    model = load_causal_lm("tiny:qwen2")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    base = model.get_base_model() if lora else model
    expected = _state_dict_names(base)
    served = served_state_dict(model)
    assert list(served) == list(expected) and "lm_head.weight" in served
    for name, tensor in served.items():
        merges = lora and name.endswith(("q_proj.weight", "down_proj.weight"))
        assert merges or tensor.data_ptr() == expected[name].data_ptr(), name
        assert torch.equal(tensor, expected[name]), name  # B starts at zero: the merge adds nothing yet


def test_a_shared_serving_model_holds_the_actors_tensors_or_falls_back_to_a_copy(caplog):
    """A plain model over the LoRA actor's tensors (the frozen base, each kept merged weight): nothing on the meta
    device, every tensor one the actor holds. An actor the class cannot take (a parameter it does not define)
    gets None and a warning naming why: the engine then keeps a copy of its own."""
    from agentrl.models import load_causal_lm
    from agentrl.training.lora import apply_lora
    from agentrl.training.lora_fused import is_fused, kept_merged_weight
    from agentrl.training.parallel.served_weights import shared_serving_model

    actor = apply_lora(load_causal_lm("tiny:qwen2"), rank=2, alpha=4, target_modules="all-linear")
    plain = shared_serving_model(actor)
    held = {t.data_ptr() for t in actor.parameters()}
    held |= {kept_merged_weight(m).data_ptr() for m in actor.modules() if is_fused(m)}
    tensors = [*plain.parameters(), *plain.buffers()]
    assert not any(t.is_meta for t in tensors) and not any(t.requires_grad for t in plain.parameters())
    assert all(p.data_ptr() in held for p in plain.parameters())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, actor(input_ids=ids).logits, atol=1e-5)

    actor.get_base_model().model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with caplog.at_level("WARNING"):
        assert shared_serving_model(actor) is None
    assert "keeps its own copy" in caplog.text and "extra" in caplog.text

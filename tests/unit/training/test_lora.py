"""LoRA: `all-linear` on vision-language models adapts the language model only; fused adapted layers equal peft's."""

import copy

import pytest
import torch

from agentrl.models import load_causal_lm
from agentrl.training import lora_fused
from agentrl.training.lora import adapters_disabled, apply_lora, low_precision_base_dtype
from agentrl.training.lora_fused import (
    fuse_lora_layers,
    is_fused,
    kept_merged_weight,
    lora_linear,
    merged_is_cheaper,
    merged_weight,
)
from agentrl.training.parallel.served_weights import served_state_dict

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


def _lora_model(dtype: str = "float32", keep_merged: bool = True):
    model = apply_lora(
        load_causal_lm("tiny:qwen2", dtype=dtype),
        rank=4,
        alpha=8,
        target_modules="all-linear",
        keep_merged=keep_merged,
    )
    for name, param in model.named_parameters():  # nonzero B, so the adapters change the output
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def _with_peft_forward(model):
    """The same model, each adapted layer running peft's own forward again."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if is_fused(module):
            del module.forward
    return twin


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach().float(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


IDS = torch.randint(10, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("merged", [False, True], ids=["thin", "merged"])
def test_lora_linear_gradients_match_finite_differences(merged):
    """Every gradient the fused function returns (input, base weight and bias when trainable, both adapters),
    either way of computing it."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True) for shape in
            ((2, 3, 5), (4, 5), (4,), (2, 5), (4, 2))]  # fmt: skip
    assert torch.autograd.gradcheck(lambda *a: lora_linear(*a, 1.5, merged=merged), args)
    x, w, b, a, bb = args
    expected = x @ w.t() + b + 1.5 * (x @ a.t()) @ bb.t()
    assert torch.allclose(lora_linear(x, w, b, a, bb, 1.5, merged=merged), expected)
    frozen = [
        t.detach().requires_grad_(i in (0, 3, 4)) for i, t in enumerate(args)
    ]  # base frozen, as in LoRA
    lora_linear(*frozen, 1.5, merged=merged).square().sum().backward()
    assert frozen[1].grad is None and frozen[2].grad is None and frozen[3].grad is not None


def test_merged_is_picked_where_the_thin_passes_cost_more_than_the_weight_gradient():
    """0.5B widths (896; MLP 4,864): every layer merged; 3B and 7B MLPs and square projections thin (where an
    H100 measured thin faster at 3B), their narrow key/value projections merged."""
    assert all(merged_is_cheaper(i, o) for i, o in ((896, 896), (896, 128), (896, 4864), (4864, 896)))
    assert not any(merged_is_cheaper(i, o) for i, o in ((2048, 2048), (2048, 11008), (11008, 2048)))
    assert not merged_is_cheaper(3584, 18944) and not merged_is_cheaper(3584, 3584)
    assert merged_is_cheaper(2048, 256) and merged_is_cheaper(3584, 512)


@pytest.mark.parametrize(
    "flops_per_byte, keep_merged",
    [(0, True), (10**9, True), (10**9, False)],
    ids=["thin", "merged-kept", "merged-per-call"],
)
def test_fused_layers_give_peft_logits_and_gradients(flops_per_byte, keep_merged, monkeypatch):
    monkeypatch.setattr(lora_fused, "FLOPS_PER_BYTE", flops_per_byte)  # every layer one way
    model = _lora_model()
    assert sum(is_fused(m) for m in model.modules()) == 7 * model.config.num_hidden_layers
    fuse_lora_layers(model, keep_merged=keep_merged)
    fused_logits, fused_grads = _logits_and_grads(model, IDS)
    peft_logits, peft_grads = _logits_and_grads(_with_peft_forward(model), IDS)
    assert torch.allclose(fused_logits, peft_logits, atol=1e-5)
    assert fused_grads.keys() == peft_grads.keys() and all("lora_" in n for n in fused_grads)
    for name, grad in fused_grads.items():
        assert torch.allclose(grad, peft_grads[name], atol=1e-5, rtol=1e-4), name


def test_disabled_or_merged_adapters_run_peft_forward():
    model = _lora_model()
    with torch.no_grad():
        adapted = model(input_ids=IDS).logits
        with adapters_disabled(model):
            base = model(input_ids=IDS).logits
        assert (adapted - base).abs().max() > 1e-4  # the adapters count ...
        plain = load_causal_lm("tiny:qwen2")(input_ids=IDS).logits
        assert torch.allclose(base, plain, atol=1e-6)  # ... and are off when disabled
        model.merge_adapter()  # the merged weights already hold the adapters: peft's forward adds nothing
        assert torch.allclose(model(input_ids=IDS).logits, adapted, atol=1e-5)


def test_float32_adapters_on_a_bf16_base_compute_in_bf16_and_keep_float32_gradients():
    """peft keeps adapters in float32 and would copy each adapted layer's bf16 input to float32; the fused
    layers multiply in bf16, gradients reach the float32 adapters in float32, and the logits agree with peft's
    float32-adapter path to bf16's precision."""
    model = _lora_model("bfloat16")
    assert low_precision_base_dtype(model) is None  # every adapted layer is fused: no autocast needed
    fused_logits, grads = _logits_and_grads(model, IDS)
    peft_logits, _ = _logits_and_grads(_with_peft_forward(model), IDS)
    assert (fused_logits - peft_logits).abs().max() < 0.05 * peft_logits.abs().max()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    assert grads and all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads.values())


def test_layers_on_peft_forward_compute_in_the_base_dtype_under_adapters_in_base_dtype():
    """Adapted layers the fused path does not cover run peft's forward, which copies each bf16 input to the
    float32 adapters' dtype; `adapters_in_base_dtype` keeps those inputs bf16 and the gradients float32."""
    from agentrl.training.lora import adapters_in_base_dtype

    model = _with_peft_forward(_lora_model("bfloat16"))
    assert low_precision_base_dtype(model) == torch.bfloat16
    seen = []
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.lora_A["default"].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    with torch.no_grad():
        model(input_ids=IDS)
    assert set(seen) == {torch.float32}  # peft's own path: every adapter input copied to float32
    seen.clear()
    with adapters_in_base_dtype(model, low_precision_base_dtype(model)):
        _, grads = _logits_and_grads(model, IDS)
    assert set(seen) == {torch.bfloat16} and len(seen) == 7 * model.config.num_hidden_layers
    assert grads and all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads.values())


def _first_adapted(model):
    return next(m for m in model.modules() if is_fused(m))


@pytest.mark.parametrize("fused_optimizer", [False, True], ids=["foreach", "fused"])
def test_a_kept_merged_weight_is_formed_again_after_each_optimizer_step(fused_optimizer):
    """The forward reuses W' until the adapters change; after an optimizer step (a fused one writes without
    bumping the parameters' versions) the next forward forms it from the new adapters, and logits and
    gradients still equal peft's."""
    model = _lora_model()
    layer = _first_adapted(model)
    _logits_and_grads(model, IDS)
    before = kept_merged_weight(layer)
    model(input_ids=IDS)  # a second forward: the same tensor, not formed again
    assert kept_merged_weight(layer).data_ptr() == before.data_ptr()
    before = before.clone()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=0.05, fused=fused_optimizer
    )
    optimizer.step()
    logits, grads = _logits_and_grads(model, IDS)
    name = layer.active_adapters[0]
    expected = merged_weight(
        layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
    )
    assert torch.equal(kept_merged_weight(layer), expected) and not torch.equal(before, expected)
    peft_logits, peft_grads = _logits_and_grads(_with_peft_forward(model), IDS)
    assert torch.allclose(logits, peft_logits, atol=1e-5)
    for key, grad in grads.items():
        assert torch.allclose(grad, peft_grads[key], atol=1e-5, rtol=1e-4), key


def test_after_an_optimizer_step_the_first_kept_weight_asked_for_forms_every_layers_again_in_place():
    """One call after an optimizer step forms every kept merged weight of the model again, each into its own
    tensor (what an engine serving them reads), in `merged_weight`'s formula from the new adapters."""
    model = _lora_model("bfloat16")
    _logits_and_grads(model, IDS)
    layers = [m for m in model.modules() if is_fused(m)]
    held = [kept_merged_weight(m) for m in layers]
    before = [t.clone() for t in held]
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05).step()
    assert kept_merged_weight(layers[-1]).data_ptr() == held[-1].data_ptr()
    for layer, tensor, old in zip(layers, held, before, strict=True):  # no other layer was asked for
        name = layer.active_adapters[0]
        expected = merged_weight(
            layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
        )
        assert torch.equal(tensor, expected) and not torch.equal(tensor, old)


def test_kept_merged_weights_are_the_served_weights_and_match_the_per_call_merge():
    """What the engine is sent for an adapted layer is the tensor the trainer's forward used, and bit for bit
    what the merge without kept weights serves (bf16 base, float32 adapters)."""
    model = _lora_model("bfloat16")
    _logits_and_grads(model, IDS)
    served = served_state_dict(model)
    layer = next(
        m for n, m in model.named_modules() if is_fused(m) and n.endswith("layers.0.self_attn.q_proj")
    )
    assert served["model.layers.0.self_attn.q_proj.weight"].data_ptr() == kept_merged_weight(layer).data_ptr()
    twin = copy.deepcopy(model)
    fuse_lora_layers(twin, keep_merged=False)
    assert kept_merged_weight(_first_adapted(twin)) is None
    per_call = served_state_dict(twin)
    assert served.keys() == per_call.keys()
    assert all(torch.equal(served[k], per_call[k]) for k in served)


def test_kept_merged_weights_under_inference_mode_and_gradient_checkpointing():
    """W' first formed inside inference mode (an evaluation) still trains; with activation checkpointing the
    recomputed forward reuses it and the gradients equal peft's."""
    model = _lora_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with torch.inference_mode():
        model(input_ids=IDS)
    logits, grads = _logits_and_grads(model, IDS)
    peft_logits, peft_grads = _logits_and_grads(_with_peft_forward(model), IDS)
    assert torch.allclose(logits, peft_logits, atol=1e-5)
    assert grads.keys() == peft_grads.keys() and grads
    for key, grad in grads.items():
        assert torch.allclose(grad, peft_grads[key], atol=1e-5, rtol=1e-4), key

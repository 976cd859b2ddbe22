"""Log-probs and entropy computed inside the output head, chunk by chunk, equal the whole-logits computation.

Real tiny models in float32: the values on response tokens, and the gradients they send into every weight
(the head's too, which the tied embedding shares), are the same whether the logits are materialised whole or a
few tokens at a time under checkpointing. A LoRA model takes the chunked path as well; the head's forward is
restored afterwards.
"""

from __future__ import annotations

import pytest
import torch

from agentrl.models import load_causal_lm
from agentrl.training.lora import apply_lora
from agentrl.training.update import forward
from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.update.forward import compute_log_probs


def _batch():
    generator = torch.Generator().manual_seed(3)
    rows = []
    for i, (prompt, response) in enumerate([(4, 3), (6, 5), (3, 7), (5, 1)]):
        ids = torch.randint(10, 1000, (prompt + response,), generator=generator).tolist()
        rows.append(TrainingRow(ids, [0] * prompt + [1] * response, [0.0] * len(ids), 1.0, str(i), str(i)))
    return rows_to_batch(rows, pad_token_id=0)


def _whole_logits(model, batch, temperature=1.0):
    """The reference: every position's logits in float32 divided by the temperature, then the same formulas."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    pad = torch.nn.functional.pad
    return pad(log_probs, (1, 0)), pad(entropy, (1, 0))


def _loss_and_grads(model, log_probs, entropy, mask):
    loss = (log_probs * mask).sum() + 0.1 * (entropy * mask).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["untempered", "tempered"])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 10_000], ids=["one-token-chunks", "five", "one-chunk"])
def test_chunked_log_probs_and_gradients_equal_whole_logits(monkeypatch, chunk_tokens, temperature):
    """Also at a sampling temperature: values and gradients of softmax(z / T), the policy the engine sampled."""
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    assert forward._chunkable_head(model) is model.lm_head
    vocab = model.lm_head.weight.shape[0]
    monkeypatch.setattr(forward, "CHUNK_ELEMENTS", chunk_tokens * vocab)
    batch = _batch()
    mask = batch.response_mask.float()

    expected_lp, expected_ent = _whole_logits(model, batch, temperature)
    expected_grads = _loss_and_grads(model, expected_lp, expected_ent, mask)
    log_probs, entropy = compute_log_probs(model, batch, with_entropy=True, temperature=temperature)
    grads = _loss_and_grads(model, log_probs, entropy, mask)

    on = batch.response_mask
    assert torch.allclose(log_probs[on], expected_lp[on], atol=1e-5)
    assert torch.allclose(entropy[on], expected_ent[on], atol=1e-5)
    assert (log_probs[~on] == 0).all() and (entropy[~on] == 0).all()  # prompts and padding cost nothing
    assert grads.keys() == expected_grads.keys() and "model.embed_tokens.weight" in grads
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5, rtol=1e-4), name
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back


def test_a_logged_only_entropy_carries_no_gradient_and_the_same_values():
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    batch = _batch()
    mask = batch.response_mask.float()
    expected_lp, expected_ent = _whole_logits(model, batch)
    expected_grads = _loss_and_grads(model, expected_lp, expected_ent.detach(), mask)
    log_probs, entropy = compute_log_probs(model, batch, with_entropy=True, entropy_grad=False)
    grads = _loss_and_grads(model, log_probs, entropy, mask)  # the 0.1 * entropy term adds no gradient
    on = batch.response_mask
    assert torch.allclose(entropy[on], expected_ent[on], atol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5, rtol=1e-4), name


def test_a_batch_without_response_tokens_still_backpropagates_zero():
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    batch = _batch()
    batch.response_mask = torch.zeros_like(batch.response_mask)
    log_probs, entropy = compute_log_probs(model, batch, with_entropy=True)
    assert (log_probs == 0).all() and (entropy == 0).all()
    (log_probs.sum() + entropy.sum()).backward()  # connected to the graph: ranks stay in step under FSDP
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


def test_lora_models_take_the_chunked_path_with_the_same_values():
    model = apply_lora(
        load_causal_lm("tiny:qwen2", dtype="float32"), rank=4, alpha=8, target_modules="all-linear"
    )
    assert forward._chunkable_head(model) is not None  # peft leaves lm_head a plain Linear
    batch = _batch()
    with torch.no_grad():
        expected, _ = _whole_logits(model, batch)
        log_probs, entropy = compute_log_probs(model, batch)
    assert entropy is None
    on = batch.response_mask
    assert torch.allclose(log_probs[on], expected[on], atol=1e-5)


def test_the_whole_logits_path_divides_by_the_temperature_too(monkeypatch):
    """Models whose head is not chunkable (soft-capped logits, custom heads) train the same tempered policy."""
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    monkeypatch.setattr(forward, "_chunkable_head", lambda _model: None)
    batch = _batch()
    with torch.no_grad():
        expected_lp, expected_ent = _whole_logits(model, batch, 0.7)
        log_probs, entropy = compute_log_probs(model, batch, with_entropy=True, temperature=0.7)
    on = batch.response_mask
    assert torch.allclose(log_probs[on], expected_lp[on], atol=1e-5)
    assert torch.allclose(entropy[on], expected_ent[on], atol=1e-5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        compute_log_probs(model, batch, temperature=0.0)


@pytest.mark.slow
def test_the_compiled_head_math_gives_the_same_values_and_gradients():
    """`compile_head=True` (what CUDA runs, `actor.use_torch_compile`) through Inductor on the CPU."""
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    batch = _batch()
    mask = batch.response_mask.float()
    expected_lp, expected_ent = _whole_logits(model, batch)
    expected_grads = _loss_and_grads(model, expected_lp, expected_ent, mask)
    log_probs, entropy = compute_log_probs(model, batch, with_entropy=True, compile_head=True)
    grads = _loss_and_grads(model, log_probs, entropy, mask)
    on = batch.response_mask
    assert torch.allclose(log_probs[on], expected_lp[on], atol=1e-5)
    assert torch.allclose(entropy[on], expected_ent[on], atol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5, rtol=1e-4), name


def test_a_head_function_that_fails_to_compile_falls_back_to_the_plain_one_loudly(caplog):
    def broken(*_args):
        raise RuntimeError("no working Triton")

    call = forward._plain_if_compile_fails(broken, forward.logit_stats)
    logits, ids = torch.randn(3, 11), torch.tensor([0, 5, 10])
    with caplog.at_level("WARNING"):
        first = call(logits, ids)
    assert "torch.compile of logit_stats failed" in caplog.text
    for got, want in zip(first, forward.logit_stats(logits, ids), strict=True):
        assert torch.equal(got, want)
    caplog.clear()
    call(logits, ids)  # from then on the plain function, without another warning
    assert caplog.text == ""


@pytest.mark.parametrize("chunk_tokens", [3, 5])
def test_the_compiled_head_math_is_traced_once_for_every_chunk(monkeypatch, chunk_tokens):
    """Chunks are views of one tensor at growing offsets, and the last may hold one position: torch.compile
    specialises a storage offset of 0 and a size of 1, so the head math compiled up to five times in the first
    step (an Inductor compile each, seconds on a GPU host). A recording backend stands in for Inductor: one
    graph each for `logit_stats` and `logit_grad`, over two steps, and the values still equal the whole logits'."""
    torch._dynamo.reset()
    traced: list[torch.fx.GraphModule] = []

    def recording(graph: torch.fx.GraphModule, example_inputs):
        traced.append(graph)
        return graph.forward

    compiled = tuple(
        torch.compile(fn, dynamic=True, backend=recording) for fn in (forward.logit_stats, forward.logit_grad)
    )
    monkeypatch.setattr(forward, "_COMPILED_MATH", compiled)
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    monkeypatch.setattr(forward, "CHUNK_ELEMENTS", chunk_tokens * model.lm_head.weight.shape[0])
    batch = _batch()
    mask = batch.response_mask.float()
    assert forward.chunk_sizes(int(batch.response_mask[:, 1:].sum()), chunk_tokens)[-1] > 1
    for _ in range(2):
        log_probs, entropy = compute_log_probs(model, batch, with_entropy=True, compile_head=True)
        _loss_and_grads(model, log_probs, entropy, mask)
    assert len(traced) == 2
    expected_lp, _ = _whole_logits(model, batch)
    on = batch.response_mask
    assert torch.allclose(log_probs[on], expected_lp[on], atol=1e-5)


def test_chunk_sizes_never_leave_one_position_alone():
    assert forward.chunk_sizes(16, 5) == [5, 5, 6]
    assert forward.chunk_sizes(16, 3) == [3, 3, 3, 3, 4]
    assert forward.chunk_sizes(15, 5) == [5, 5, 5]
    assert forward.chunk_sizes(1, 5) == [1]
    assert forward.chunk_sizes(7, 10_000) == [7]


def test_under_autocast_the_head_recomputes_its_logits_in_the_forwards_dtype(monkeypatch):
    """Float32 weights computing in bfloat16 (the local backend's mixed precision): the chunked head's backward
    recomputes the logits under the forward's autocast, so its gradients are the whole-logits path's under the
    same autocast (recomputed in float32 they would belong to other logits than the forward's)."""
    model = load_causal_lm("tiny:qwen2", dtype="float32")
    monkeypatch.setattr(forward, "CHUNK_ELEMENTS", 5 * model.lm_head.weight.shape[0])
    batch = _batch()
    mask = batch.response_mask.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_lp, expected_ent = _whole_logits(model, batch)
    expected_grads = _loss_and_grads(model, expected_lp, expected_ent, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, entropy = compute_log_probs(model, batch, with_entropy=True)
    grads = _loss_and_grads(model, log_probs, entropy, mask)
    on = batch.response_mask
    assert torch.allclose(log_probs[on], expected_lp[on], atol=1e-5)
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        # bf16 rounding in another order: 0-0.14% here (the tied embedding sums the head's gradient in bf16);
        # a backward recomputing in float32 was 0.26-0.6% off
        error = (grad - expected_grads[name]).norm() / expected_grads[name].norm()
        assert error < 2e-3, (name, error.item())

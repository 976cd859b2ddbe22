"""Supervised warm start: cross-entropy on (prompt, reference response) pairs before RL.

A tiny model starts RL with zero reward on most tasks, and GRPO learns nothing from groups that all fail.
A short SFT pass on the training rows' reference responses (`extra_info.response`, else the ground truth)
gives it a non-zero start. Prompts are rendered exactly as the gateway renders them (`render_chat`, the
model's chat template), including a row's `tools` schema: a model warm-started on tool calls then sees
the same tool preamble at RL time, when the flow passes `tools=`. Rows with images (verl's `images` beside
`<image>`, or image parts) train a vision-language policy on the same pixels and image pads the engine
would serve (`agentrl.rollout.engines.vision`). A progress bar counts the steps.

Where a warm start ends decides whether RL has anything to compare: a fixed step count lands on either side of
a sharp jump in what a small model gets right, depending on the data order. With `sft.val_rows`, the last rows
are held out and checked every `sft.val_freq` steps (the share whose response is the model's greedy output),
and `sft.stop_accuracy` ends the warm start at the first check that reaches it: every seed then starts RL
from the same competence rather than the same step.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from agentrl.data.images import build_image_messages, has_image_parts, load_image_processor
from agentrl.rollout.chat import render_chat
from agentrl.rollout.engines.vision import build_image_prompt, collect_image_refs
from agentrl.tracking import progress_bar
from agentrl.training.optim import build_optimizer
from agentrl.training.parallel.distributed import all_reduce_sum, is_distributed, world_size

log = logging.getLogger("agentrl")


def reference_response(row: dict[str, Any]) -> str:
    """The target text for a row: `extra_info.response`, else `reward_model.ground_truth`."""
    extra = row.get("extra_info") or {}
    if extra.get("response"):
        return str(extra["response"])
    return str((row.get("reward_model") or {}).get("ground_truth", ""))


def build_sft_examples(
    tokenizer: Any, rows: Sequence[dict[str, Any]], prompt_key: str = "prompt", image_model: Any = None
) -> list[tuple[list[int], list[int], Any]]:
    """(input_ids, loss_mask, image inputs or None) per row: the chat prompt (with the row's `tools`, if
    any), then the response and the end-of-turn token. `image_model`: the vision-language policy whose
    processor turns a row's images into pixels (None for text policies)."""
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for index, row in enumerate(rows):
        messages, images = row[prompt_key], None
        if image_model is not None and (row.get("images") or has_image_parts(messages)):
            messages = build_image_messages(messages, row.get("images"), f"SFT row {index}")
        prompt = render_chat(tokenizer, messages, tools=row.get("tools"))
        if image_model is not None and has_image_parts(messages):
            processor = load_image_processor(image_model.name_or_path)
            refs = collect_image_refs(messages)
            prompt, images = build_image_prompt(prompt, refs, processor, image_model.config.image_token_id)
        response = tokenizer.encode(reference_response(row), add_special_tokens=False) + [end_of_turn]
        examples.append((list(prompt) + response, [0] * len(prompt) + [1] * len(response), images))
    return examples


def run_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    sft: Any,
    *,
    seed: int,
    pad_token_id: int,
    prompt_key: str = "prompt",
    forward_context: Callable[[], AbstractContextManager] = nullcontext,
) -> dict[str, float]:
    """Train `model` in place for `sft.epochs` (or `sft.max_steps`), or until the held-out rows (the last
    `sft.val_rows`) reach `sft.stop_accuracy`; returns the first and last loss, the steps run and the last
    held-out accuracy (`sft/val_accuracy`, with val_rows). Each forward runs inside `forward_context()` (the
    policy worker's autocast over float32 master weights)."""
    if sft.val_rows >= len(rows):
        raise ValueError(
            f"sft.val_rows={sft.val_rows} would hold out all {len(rows)} SFT rows; set it below {len(rows)}"
        )
    vision = getattr(model.config, "vision_config", None) is not None
    examples = build_sft_examples(tokenizer, rows, prompt_key, model if vision else None)
    held_out = examples[len(examples) - sft.val_rows :] if sft.val_rows else []
    examples = examples[: len(examples) - sft.val_rows]
    device = next(model.parameters()).device
    optimizer = build_optimizer(model.parameters(), _SFTOptim(sft.lr))
    rng = random.Random(seed)
    batches: list[list[int]] = []
    for _ in range(sft.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        batches += [order[start : start + sft.batch_size] for start in range(0, len(order), sft.batch_size)]
    batches = batches[: sft.max_steps] if sft.max_steps is not None else batches
    model.train()
    losses: list[float] = []
    accuracy: dict[str, float] = {}
    rows_here = 0
    with progress_bar("sft", len(batches)) as bar:
        for step, batch in enumerate(batches, 1):
            mine, weight = _share_of(batch)
            input_ids, labels, attention = _pad([examples[i][:2] for i in mine], pad_token_id)
            with forward_context():
                out = model(
                    input_ids=input_ids.to(device),
                    attention_mask=attention.to(device),
                    labels=labels.to(device),
                    use_cache=False,
                    **_pixels([examples[i][2] for i in mine], input_ids.to(device), model),
                )
            optimizer.zero_grad(set_to_none=True)
            loss, scale = _global_mean(out.loss, labels, weight)
            (out.loss * scale).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss)
            rows_here += len(mine) if weight else 0
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if held_out and (step % sft.val_freq == 0 or step == len(batches)):
                accuracy["sft/val_accuracy"] = greedy_match_rate(
                    model, held_out, pad_token_id, sft.batch_size
                )
                log.info("sft step %d: held-out accuracy %.3f", step, accuracy["sft/val_accuracy"])
                if sft.stop_accuracy is not None and accuracy["sft/val_accuracy"] >= sft.stop_accuracy:
                    break
    return {**_summary(losses, len(losses)), **accuracy, "sft/rows_on_rank0": float(rows_here)}


def greedy_match_rate(
    model: torch.nn.Module,
    examples: Sequence[tuple[list[int], list[int], Any]],
    pad_token_id: int,
    batch_size: int,
) -> float:
    """Share of `examples` whose every response token (loss-mask 1, end of turn included) is the argmax of the
    model's logits after the tokens before it. With the reference as context this is exactly the share that
    greedy decoding from the prompt reproduces, at the cost of one forward pass per example."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits = 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            input_ids, labels, attention = _pad([e[:2] for e in chunk], pad_token_id)
            input_ids = input_ids.to(device)
            logits = model(
                input_ids=input_ids,
                attention_mask=attention.to(device),
                use_cache=False,
                **_pixels([e[2] for e in chunk], input_ids, model),
            ).logits
            target = labels[:, 1:].to(device)
            right = (logits[:, :-1].argmax(-1) == target) | (target == -100)
            hits += int(right.all(-1).sum())
    model.train(was_training)
    return hits / len(examples)


def _share_of(batch: list[int]) -> tuple[list[int], float]:
    """This rank's rows of a global SFT batch (every rank's share, one pass over the batch between them).

    A rank left without rows (a batch smaller than the group) runs one row at weight 0, so the FSDP
    collectives of its forward and backward still meet the other ranks'.
    """
    if not is_distributed():
        return batch, 1.0
    mine = batch[dist.get_rank() :: world_size()]
    return (mine, 1.0) if mine else (batch[:1], 0.0)


def _global_mean(local_mean: torch.Tensor, labels: torch.Tensor, weight: float) -> tuple[float, float]:
    """The batch's token-mean loss over all ranks, and the factor that makes this rank's gradient its share.

    Each rank's loss is a mean over its own target tokens; FSDP averages gradients over ranks. Scaling by
    world x local tokens / global tokens makes the average the gradient of the one global token mean, as one
    process computes it on the whole batch.
    """
    if not is_distributed():
        return local_mean.item(), 1.0
    tokens = float((labels[:, 1:] != -100).sum()) * weight
    total = all_reduce_sum(tokens)
    loss_sum = all_reduce_sum(local_mean.item() * tokens)
    return loss_sum / max(total, 1.0), world_size() * tokens / max(total, 1.0)


def _pixels(images: list[Any], input_ids: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The batch's pixel inputs (rows in order) and image-pad types, from which the model computes mrope."""
    present = [x for x in images if x is not None]
    if not present:
        return {}
    return {
        "pixel_values": torch.cat([x.pixel_values for x in present]).to(input_ids.device),
        "image_grid_thw": torch.cat([x.image_grid_thw for x in present]).to(input_ids.device),
        "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
    }


class _SFTOptim:
    def __init__(self, lr: float) -> None:
        self.lr, self.weight_decay, self.betas = lr, 0.0, (0.9, 0.999)


def _pad(chunk: list[tuple[list[int], list[int]]], pad_token_id: int):
    length = max(len(ids) for ids, _ in chunk)
    input_ids = torch.full((len(chunk), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(chunk), length), -100, dtype=torch.long)
    attention = torch.zeros((len(chunk), length), dtype=torch.long)
    for b, (ids, mask) in enumerate(chunk):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        labels[b, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    return input_ids, labels, attention


def _summary(losses: list[float], steps: int) -> dict[str, float]:
    tail = losses[-10:] or [float("nan")]
    return {
        "sft/steps": float(steps),
        "sft/first_loss": losses[0] if losses else float("nan"),
        "sft/final_loss": sum(tail) / len(tail),
    }

"""The largest gap between the logprobs an engine reported and a teacher-forced forward of the same weights."""

from __future__ import annotations

import torch


def worst_logprob_gap(
    model: torch.nn.Module,
    prompts: list[list[int]],
    groups: list[list],
    temperatures: list[float] | None = None,
) -> float:
    """`groups[i]`: the engine's outputs (token_ids, logprobs) for `prompts[i]`, sampled at `temperatures[i]`
    (default 1); the max absolute difference from log softmax(logits / temperature) of a teacher-forced forward."""
    worst = 0.0
    temperatures = temperatures or [1.0] * len(prompts)
    for prompt, outs, temperature in zip(prompts, groups, temperatures, strict=True):
        for out in outs:
            ids = torch.tensor([prompt + out.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            reference = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
            worst = max(worst, (reference.cpu() - torch.tensor(out.logprobs)).abs().max().item())
    return worst

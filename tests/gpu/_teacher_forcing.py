"""The largest gap between the logprobs an engine reported and a teacher-forced forward of the same weights."""

from __future__ import annotations

import torch


def worst_logprob_gap(model: torch.nn.Module, prompts: list[list[int]], groups: list[list]) -> float:
    """`groups[i]`: the engine's outputs (token_ids, logprobs) for `prompts[i]`; the max absolute difference."""
    worst = 0.0
    for prompt, outs in zip(prompts, groups, strict=True):
        for out in outs:
            ids = torch.tensor([prompt + out.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            reference = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
            worst = max(worst, (reference.cpu() - torch.tensor(out.logprobs)).abs().max().item())
    return worst

"""What a teacher-forced forward gives a completion: the reference the engine's logprobs are checked against."""

from typing import Any

import torch


def teacher_forced_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float = 1.0):
    """log softmax(z / T) of one forward over prompt + completion at each completion token (what the trainer
    computes)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def teacher_forcing_gap(model: Any, prompt: list[int], out: Any) -> float:
    """The largest difference between an engine output's logprobs and teacher forcing of its tokens."""
    forced = teacher_forced_logprobs(model, prompt, out.token_ids)
    return (forced - torch.tensor(out.logprobs)).abs().max().item()

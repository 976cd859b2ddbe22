"""The decoder layer's part after attention on a GPU, with the MLP's down projection as one multiply or split along
its inner dimension (`_fused_projections.split_inner_linear`, what the embedded engine runs on CUDA): the output
projection, the residual adds and norms, gate and up as one multiply, SiLU, then the down projection, compiled by
Inductor as the engine compiles `layer_output`, for 24 layers of the Qwen2.5-0.5B shape (each its own weights, so
no layer finds another's in the L2 cache), one CUDA graph a replay, by the tokens a forward carries.

    python benchmarks/down_projection.py --tokens 16 64 256 448 576 640 768 1024 2048 --splits 1 2 4

Prints one JSON line per size: microseconds a layer for each split count and each one's largest difference from
the one multiply (bfloat16 rounding of the down projection's parts).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from extend_attention import time_graph  # this folder is on the path when a benchmark runs as a script

from agentrl.rollout.engines._fused_projections import split_inner_linear

HIDDEN, INNER, LAYERS = 896, 4864, 24


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = hidden.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype) * weight


def output_part(splits: int):
    """The layer's part after attention, its down projection in `splits` parts (1: one multiply)."""

    def part(hidden, attended, o, norm, gate_up, down, following_norm):
        hidden = hidden + F.linear(attended, o)
        gate, up = F.linear(rms_norm(hidden, norm), gate_up).chunk(2, dim=-1)
        inner = F.silu(gate) * up
        mlp = F.linear(inner, down) if splits == 1 else split_inner_linear(inner, down, splits)
        hidden = hidden + mlp
        return hidden, rms_norm(hidden, following_norm)

    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[16, 64, 256, 448, 576, 640, 768, 1024, 2048]
    )
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch._dynamo.config.cache_size_limit = 64  # one compile per (size, split count)
    torch._dynamo.config.accumulated_cache_size_limit = 1024

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * 0.03

    layers = [
        {
            "o": weight(HIDDEN, HIDDEN),
            "norm": torch.ones(HIDDEN, device=device, dtype=dtype),
            "gate_up": weight(2 * INNER, HIDDEN),
            "down": weight(HIDDEN, INNER),
            "following_norm": torch.ones(HIDDEN, device=device, dtype=dtype),
        }
        for _ in range(LAYERS)
    ]
    compiled = {s: torch.compile(output_part(s), dynamic=False) for s in args.splits}
    for tokens in args.tokens:
        hidden = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
        attended = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
        one = compiled[args.splits[0]](hidden, attended, **layers[0])[0].float()
        row: dict[str, object] = {"tokens": tokens}
        for splits, part in compiled.items():
            difference = (part(hidden, attended, **layers[0])[0].float() - one).abs().max().item()
            turn = iter(range(10**9))

            def step(part=part, turn=turn, hidden=hidden, attended=attended):
                return part(hidden, attended, **layers[next(turn) % LAYERS])

            row[f"us_splits_{splits}"] = round(time_graph(step, LAYERS, 20) / LAYERS * 1000, 2)
            row[f"max_difference_splits_{splits}"] = round(difference, 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""What fusing a decoder layer's parallel projections would save on a GPU: the matrix multiplies of 24 layers of the
Qwen2.5-0.5B shape as the engine runs them (queries, keys and values as three projections, the MLP's gate and up
as two) against one projection for queries, keys and values and one for gate and up, each as one CUDA graph, by
the tokens a forward carries (a decode step's rows, or a prefill's tokens). Attention, norms and rotary are left
out: only the multiplies differ.

    python benchmarks/fused_projections.py --tokens 64 128 256 576 1024 3072

Prints one JSON line per size: milliseconds a replay each way and the share saved.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from extend_attention import time_graph  # this folder is on the path when a benchmark runs as a script


def layer_weights(hidden: int, inner: int, heads_width: int, kv_width: int, device, dtype) -> dict:
    """One layer's weights, separate and concatenated (the fused copies a fusing engine would keep)."""

    def weight(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, device=device, dtype=dtype) * 0.02

    w = {
        "q": weight(heads_width, hidden),
        "k": weight(kv_width, hidden),
        "v": weight(kv_width, hidden),
        "o": weight(hidden, heads_width),
        "gate": weight(inner, hidden),
        "up": weight(inner, hidden),
        "down": weight(hidden, inner),
    }
    for name in ("q", "k", "v"):
        w[f"{name}_bias"] = torch.zeros(w[name].shape[0], device=device, dtype=dtype)
    w["qkv"] = torch.cat([w["q"], w["k"], w["v"]])
    w["qkv_bias"] = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]])
    w["gate_up"] = torch.cat([w["gate"], w["up"]])
    return w


def separate(layers: list[dict], x: torch.Tensor) -> torch.Tensor:
    for w in layers:
        q = F.linear(x, w["q"], w["q_bias"])
        # the keys and values go to the cache: their multiplies' cost is what counts here
        F.linear(x, w["k"], w["k_bias"])
        F.linear(x, w["v"], w["v_bias"])
        x = x + F.linear(q, w["o"])
        x = x + F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
    return x


def fused(layers: list[dict], x: torch.Tensor) -> torch.Tensor:
    for w in layers:
        q = F.linear(x, w["qkv"], w["qkv_bias"])[:, : w["q"].shape[0]]
        x = x + F.linear(q, w["o"])
        gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, w["down"])
    return x


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 576, 1024, 3072])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--inner", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    head_dim = args.hidden // args.heads
    layers = [
        layer_weights(args.hidden, args.inner, args.hidden, args.kv_heads * head_dim, device, dtype)
        for _ in range(args.layers)
    ]
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
        apart = time_graph(functools.partial(separate, layers, x), 1, args.repeats)
        together = time_graph(functools.partial(fused, layers, x), 1, args.repeats)
        print(
            json.dumps(
                {
                    "tokens": tokens,
                    "separate_ms": round(apart, 3),
                    "fused_ms": round(together, 3),
                    "saved": round(1 - together / apart, 3),
                }
            )
        )


if __name__ == "__main__":
    main()

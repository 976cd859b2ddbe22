"""A decode step's attention on the CPU: scaled-dot-product attention against two matrix products and a softmax.

A decode step attends with a few query rows per kv head (its query heads, one token each) over every cached
position of its row: `_slot_decode.decode_attention` takes the matrix products on the CPU. This times both forms
on the shapes given (rows, positions read, head size, kv heads, query heads per kv head), over a strided view of
a slot cache as the engine reads it, with an additive mask of rows of different lengths, and checks they agree:

    python benchmarks/decode_attention.py                  # tiny:qwen2's shape and some larger ones
    python benchmarks/decode_attention.py --threads 1 --shapes 32x640x32x2x2
    python benchmarks/decode_attention.py --model tiny:qwen2 --rows 32 --span 640   # whole decode steps too

Prints milliseconds per call (median of `--rounds` timed runs of `--calls` calls) and SDPA / matmul. With
`--model`, also a whole `decode_step` of that model (float32, random cache) with each form in the layers, the two
timed in alternating runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from agentrl.models import load_causal_lm
from agentrl.rollout.engines import _slot_decode
from agentrl.rollout.engines._slot_decode import KVShape, decode_attention, decode_step

DEFAULT_SHAPES = ["32x640x32x2x2", "32x1024x32x2x2", "8x640x32x2x2", "32x640x64x3x3", "32x640x64x2x7"]
"""rows x positions x head size x kv heads x query heads per kv head: tiny:qwen2 (head 32, 2 kv heads of 2),
SmolLM2-135M (64, 3 of 3), Qwen2.5-0.5B (64, 2 of 7)."""


def _inputs(rows: int, span: int, head: int, kv_heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    keys = torch.randn(rows + 8, kv_heads, 2 * span, head)  # the cache: more slots and positions than read
    values = torch.randn(rows + 8, kv_heads, 2 * span, head)
    query = torch.randn(rows, kv_heads, groups, head)
    reach = torch.randint(span // 2, span, (rows,))
    visible = (torch.arange(span) <= reach[:, None])[:, None, None, :]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return query, keys[:rows, :, :span], values[:rows, :, :span], mask


def _time(fn, calls: int, rounds: int) -> float:
    for _ in range(max(5, calls // 10)):
        fn()
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(runs)


def _row(spec: str, calls: int, rounds: int) -> str:
    """One shape's table row: both forms checked against each other, then timed."""
    rows, span, head, kv_heads, groups = (int(x) for x in spec.split("x"))
    query, keys, values, mask = _inputs(rows, span, head, kv_heads, groups)
    sdpa = functools.partial(
        F.scaled_dot_product_attention, query, keys, values, attn_mask=mask, scale=head**-0.5
    )
    matmul = functools.partial(decode_attention, query, keys, values, attn_mask=mask, scale=head**-0.5)
    torch.testing.assert_close(matmul(), sdpa(), rtol=1e-4, atol=1e-5)
    sdpa_ms, matmul_ms = _time(sdpa, calls, rounds), _time(matmul, calls, rounds)
    return f"| {rows} | {span} | {head} | {kv_heads} | {groups} | {sdpa_ms:.3f} | {matmul_ms:.3f} | {sdpa_ms / matmul_ms:.2f} |"


def _sdpa_attention(query, keys, values, attn_mask, scale):
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, scale=scale)


def _decode_steps(model_name: str, rows: int, span: int, calls: int, rounds: int) -> str:
    """Whole decode steps of `model_name` with SDPA and with the matrix products in its layers, alternating."""
    model = load_causal_lm(model_name, dtype="float32", device="cpu").eval()
    shape = KVShape.of(model)
    torch.manual_seed(0)
    size = (rows + 8, shape.kv_heads, 2 * span, shape.head_dim)
    keys = [torch.randn(size) for _ in range(shape.layers)]
    values = [torch.randn(size) for _ in range(shape.layers)]
    token_ids = torch.randint(0, model.config.vocab_size, (rows,))
    positions = torch.randint(span // 2, span - 1, (rows,))
    step = functools.partial(decode_step, model, keys, values, token_ids, positions, None, span)
    times: dict[str, list[float]] = {"SDPA": [], "matmul": []}
    for _ in range(rounds):
        for name, attend in (("SDPA", _sdpa_attention), ("matmul", decode_attention)):
            _slot_decode.decode_attention = attend
            times[name].append(_time(step, calls, 1))
    _slot_decode.decode_attention = decode_attention
    sdpa, matmul = statistics.median(times["SDPA"]), statistics.median(times["matmul"])
    return f"{model_name} decode step, {rows} rows over {span} positions: SDPA {sdpa:.3f} ms, matmul {matmul:.3f} ms ({sdpa / matmul:.2f}x)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes", nargs="+", default=DEFAULT_SHAPES, help="rows x positions x head x kv x groups"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", help="also time whole decode steps of this model (e.g. tiny:qwen2)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--span", type=int, default=640)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU, {args.threads} torch threads; ms a call, median of {args.rounds} runs of {args.calls} calls")
    print("| rows | positions | head | kv heads | groups | SDPA ms | matmul ms | SDPA / matmul |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with torch.inference_mode():
        for spec in args.shapes:
            print(_row(spec, args.calls, args.rounds))
        if args.model:
            print(_decode_steps(args.model, args.rows, args.span, args.calls // 2, 2 * args.rounds))


if __name__ == "__main__":
    main()

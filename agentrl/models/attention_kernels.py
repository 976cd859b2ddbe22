"""Which attention kernels training and the engine's CUDA graphs use.

For a padded batch (an attention mask), PyTorch's scaled-dot-product attention picks cuDNN's kernel first on
recent GPUs, and cuDNN builds an execution plan for every new shape it meets. An RL batch has new shapes at
nearly every step (answers of new lengths, token-budgeted micro-batches): on an H200, single SmolLM2-135M
reference forwards and updates stalled 1-2 s inside the attention call (the main thread, sampled every 10 ms,
sat there for 120 samples of a 2.5 s update). Training workers therefore leave cuDNN's attention out
(`skip_cudnn_attention`; the memory-efficient and flash kernels need no plan): 20 steps' updates took 5.1-5.6 s
against 7.7-9.0 s. A CUDA graph is different: it is captured once per shape and replayed, so the plan is built
once, and the engine's decode ran faster on cuDNN (5.4-5.7 s of decoding against 7.8 s without it): graphs are
captured with it allowed (`cudnn_attention_for_capture`). The switch is process-wide: while a capture runs, a
training forward in another thread (asynchronous training on the local backend, whose engine captures beside the
update in its first steps) may pick cuDNN too; captures stop once every shape has its graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def skip_cudnn_attention(device: torch.device) -> None:
    """Leave cuDNN's attention out of this process's choices on a CUDA device (process-wide, as PyTorch's
    backend switches are; `cudnn_attention_for_capture` lets graph captures have it)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


@contextlib.contextmanager
def cudnn_attention_for_capture() -> Iterator[None]:
    """cuDNN's attention allowed inside the block (a graph's warm-up and capture), the switch restored after."""
    allowed = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(allowed)

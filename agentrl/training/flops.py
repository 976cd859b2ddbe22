"""Model FLOPs utilisation of a training pass (verl's `perf/mfu/actor`): achieved model FLOPs over the peak.

Model FLOPs count what the math needs, not what ran: a forward and backward of a decoder is 6 x (its matmul
parameters) per token, plus the attention scores, 12 x layers x heads x head_dim per (token, token) pair (all
pairs, causal or not, as verl's FLOPs counter counts them; PaLM's appendix has the formula). Recomputation under
gradient checkpointing is not counted (it is overhead), so checkpointing lowers the MFU as it should. The peak is the dense bf16/fp16
(or fp32) tensor-core figure of the device, from its datasheet; an unknown device has no MFU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Dense (no sparsity) peak FLOP/s per device, by the name CUDA reports: (bf16/fp16, fp32 without TF32).
_PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),  # SXM; the PCIe card is lower (756e12), matched first below
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (125e12, 31.2e12),
}


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of `device` computing in `dtype`, or None when not known (CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    if "H100" in name and "PCIe" in name:
        return 756e12 if low_precision else 51e12
    for key, (half, full) in _PEAK_FLOPS.items():
        if key in name:
            return half if low_precision else full
    return None


def training_flops(config, sequence_lengths: Sequence[int]) -> float:
    """Model FLOPs of one forward and backward pass over sequences of these lengths (a transformers config)."""
    config = getattr(config, "text_config", None) or config
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden  # q, k, v, o
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    matmul_params = layers * (attention + mlp) + config.vocab_size * hidden  # the output head
    tokens = sum(sequence_lengths)
    scores = 12 * layers * heads * head_dim * sum(n * n for n in sequence_lengths)
    return 6 * matmul_params * tokens + scores


def mfu(config, sequence_lengths: Sequence[int], seconds: float, peak_flops: float | None) -> float | None:
    """Achieved share of `peak_flops` for one training pass over these sequences in `seconds`."""
    if peak_flops is None or seconds <= 0:
        return None
    return training_flops(config, sequence_lengths) / seconds / peak_flops

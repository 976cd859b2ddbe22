"""A worker group of one still forms a process group, so FSDP2 (and parameter offload) works on one device.

The 1.5B parameter-offload run on one GPU trained nothing sharded: with no group, the actor stayed a plain
module loaded on the CPU and its forward ran there (`the actor's forward ran on cpu`).
"""

from __future__ import annotations

import socket

import torch
from torch.distributed.tensor import DTensor

from agentrl.models import load_causal_lm
from agentrl.training.parallel.distributed import (
    destroy_process_group,
    init_worker_process_group,
    is_distributed,
)
from agentrl.training.parallel.fsdp import compute_device, shard_model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_one_rank_joins_a_group_and_shards_with_offload_requested():
    init_worker_process_group(0, 1, f"tcp://127.0.0.1:{_free_port()}", "cpu")
    try:
        assert torch.distributed.is_initialized() and not is_distributed()  # a group, but nothing to reduce
        model = load_causal_lm("tiny:qwen2", dtype="float32", device="cpu")
        shard_model(model, compute_dtype=None, offload=True, device_type="cpu")  # no-op offload on a CPU mesh
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert compute_device(model) == torch.device("cpu")
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
        logits.sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    finally:
        destroy_process_group()

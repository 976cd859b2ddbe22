"""torch.distributed inside a worker: joining the group, and the few collectives the update loop needs.

A worker group of one (the local backend) never initialises a process group; every helper here then
returns its input, so the worker code path is the same for one process and for N.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist


def init_worker_process_group(rank: int, world_size: int, init_method: str, device: str) -> None:
    """Join the group: NCCL on CUDA, gloo on CPU. A hung peer fails collectives after 10 minutes.

    A group of one is joined too: FSDP2 (and with it parameter offload) needs a process group, and one GPU
    under the Ray backend offloads like eight.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast is off on the lent machines
        torch.cuda.set_device(0)  # Ray shows each actor its own GPU as device 0
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    return float(tensor.item())


def all_reduce_max_int(value: int) -> int:
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def all_reduce_sum_dict(values: Mapping[str, float]) -> dict[str, float]:
    """Sum each metric over ranks (every rank must pass the same keys)."""
    if not is_distributed():
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist(), strict=True))


def all_reduce_max_dict(values: Mapping[str, float]) -> dict[str, float]:
    """The largest value of each metric over ranks (every rank must pass the same keys)."""
    if not is_distributed():
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.tolist(), strict=True))


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

"""FSDP2 for the workers of the Ray backend: shard a transformers model, and read full tensors back out.

`fully_shard` wraps every decoder layer (the classes the model lists in `_no_split_modules`), then the root,
so one layer's parameters are gathered at a time. On GPU with a low-precision `model.dtype` the master weights
stay float32 and compute runs in that dtype, with gradients reduced in float32 (verl's default). Parameter
offload keeps shards (and, with them, gradients and the optimizer step) on the CPU.

`fsdp_size` (verl's `fsdp_config.fsdp_size`) picks the mesh: -1 (or the world size) shards every parameter over
all ranks; a divisor of the world size makes it HSDP, a 2-D mesh (replicate, shard) whose rows are groups of
`fsdp_size` consecutive ranks (one node's devices when it equals `trainer.n_gpus_per_node`): parameters are
all-gathered and gradients reduce-scattered inside a group, and only the gradient shards are all-reduced across
groups, so the slow links between nodes carry 1/fsdp_size of the model per step instead of the all-gathers.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: modules whose class the model marks `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find decoder layers to shard in {type(model).__name__} (_no_split_modules)")
    return layers


def mesh_shape(world_size: int, fsdp_size: int) -> tuple[int, ...]:
    """(world,) for plain FSDP (`fsdp_size` <= 0 or >= world), else (world // fsdp_size, fsdp_size) for HSDP."""
    if fsdp_size <= 0 or fsdp_size >= world_size:
        return (world_size,)
    if world_size % fsdp_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"fsdp_config.fsdp_size={fsdp_size} does not divide the {world_size} ranks of the worker group; "
            f"choose one of {divisors} (or -1 to shard over all ranks)"
        )
    return (world_size // fsdp_size, fsdp_size)


def build_mesh(device_type: str, fsdp_size: int = -1):
    """The device mesh `fully_shard` shards over: 1-D ("fsdp") or, for HSDP, 2-D ("replicate", "fsdp")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(dist.get_world_size(), fsdp_size)
    names = ("fsdp",) if len(shape) == 1 else ("replicate", "fsdp")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def shard_model(
    model: torch.nn.Module,
    *,
    compute_dtype: torch.dtype | None,
    offload: bool,
    device_type: str,
    fsdp_size: int = -1,
) -> torch.nn.Module:
    """Apply FSDP2 in place (per decoder layer, then the root) over the default process group; a 2-D mesh
    (`fsdp_size` dividing the world) makes it HSDP.

    The mesh names the compute device explicitly: with parameter offload the model is loaded on the CPU, and
    a mesh inferred from there would run every forward on the CPU too.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mixed = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    # On a CPU mesh the shards already live in host memory: offloading them is a no-op (and pinning fails).
    policy = CPUOffloadPolicy() if offload and device_type != "cpu" else OffloadPolicy()
    mesh = build_mesh(device_type, fsdp_size)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mixed, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=policy)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor shard (a collective: every rank calls it in the same order)."""
    if not isinstance(value, DTensor):
        return value.detach()
    local = value.to_local()
    mesh_device = value.device_mesh.device_type
    if local.device.type != mesh_device:  # an offloaded shard: gather on the mesh's device
        local = local.to(mesh_device)
        value = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False)
    return value.full_tensor().detach()


def compute_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes: a sharded (possibly CPU-offloaded) parameter answers with its mesh's device."""
    param = next(model.parameters())
    if isinstance(param, DTensor):
        return torch.device(param.device_mesh.device_type)
    return param.device

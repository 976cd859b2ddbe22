"""The Ray side of the `ray` backend: start (or join) Ray, reserve the devices, build the worker groups.

Ray is joined when `RAY_ADDRESS` names a running cluster (`ray start --head` on one machine, `ray start
--address=...` on the others), or when the caller already connected; otherwise a local Ray starts with this
machine's resources. Each node of the run gets a placement group of `trainer.n_gpus_per_node` one-device
bundles, packed on one node: with `trainer.nnodes > 1` each group is pinned to a different node (Ray's
`ray.io/node-id` label), so ranks `k * n_gpus_per_node ...` share node k, which is what HSDP's shard groups
(`fsdp_config.fsdp_size = n_gpus_per_node`) and NCCL's intra-node links need.

The policy workers take the first `resource_pool_config.actor_rollout_gpus` devices and the critic workers the
first `resource_pool_config.critic_gpus` (both default to every device); where they share a device each takes
half of it. The reference policy lives inside the policy workers (colocated, as in verl's hybrid engine).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from agentrl.training.workers.worker_group import RayWorkerGroup

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig

log = logging.getLogger(__name__)
_READY_TIMEOUT_S = 120


def connect_ray(world: int, use_gpu: bool) -> bool:
    """Join the cluster `RAY_ADDRESS` names, or start a local Ray; False when this process was connected
    already (then the caller's connection is left alone at shutdown)."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:  # a running cluster: its nodes declared their own resources at `ray start`
        ray.init(address=address, log_to_driver=True)
        return True
    resources = {"num_gpus": world} if use_gpu else {}
    ray.init(
        num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True, **resources
    )
    return True


def pick_nodes(
    nodes: list[dict[str, Any]], count: int, per_node: int, resource: str, first: str
) -> list[str]:
    """Ids of `count` alive nodes with at least `per_node` of `resource`, the driver's node (`first`) first."""
    able = [
        n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get(resource, 0) >= per_node
    ]
    able.sort(key=lambda node: (node != first, node))
    if len(able) < count:
        found = {n["NodeID"][:12]: n.get("Resources", {}).get(resource, 0) for n in nodes if n.get("Alive")}
        raise RuntimeError(
            f"trainer.nnodes={count} needs {count} Ray nodes with {per_node} {resource} each "
            f"(trainer.n_gpus_per_node); the cluster has {len(able)}: {resource} per node {found}"
        )
    return able[:count]


class RayCluster:
    """Owns the Ray connection (when it made it) and one placement group per node of the run."""

    def __init__(self, config: AgentRLConfig, device: str) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.config = config
        self.device = device
        self.use_gpu = device.startswith("cuda")
        trainer = config.trainer
        self.per_node = trainer.n_gpus_per_node
        self.world = self.per_node * trainer.nnodes
        self.placement_groups: list[Any] = []
        self.connected = connect_ray(self.world, self.use_gpu)
        resource = "GPU" if self.use_gpu else "CPU"
        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        try:
            if trainer.nnodes == 1:
                pins: list[dict[str, str] | None] = [None]
            else:
                first = ray.get_runtime_context().get_node_id()
                nodes = pick_nodes(ray.nodes(), trainer.nnodes, self.per_node, resource, first)
                pins = [{"ray.io/node-id": node} for node in nodes]
            for pin in pins:
                self.placement_groups.append(
                    placement_group(
                        [dict(bundle) for _ in range(self.per_node)],
                        strategy="STRICT_PACK",
                        bundle_label_selector=None if pin is None else [pin] * self.per_node,
                    )
                )
            ray.get([group.ready() for group in self.placement_groups], timeout=_READY_TIMEOUT_S)
        except Exception as error:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not reserve {trainer.nnodes} node(s) x {self.per_node} x {bundle} "
                f"(trainer.nnodes x trainer.n_gpus_per_node): {error}; cluster resources: {ray.cluster_resources()}"
            ) from error

    def bundles(self, devices: int) -> list[tuple[Any, int]]:
        """(placement group, bundle index) of ranks 0..devices-1: node by node, so a node's ranks are consecutive."""
        return [
            (self.placement_groups[rank // self.per_node], rank % self.per_node) for rank in range(devices)
        ]

    def worker_group(self, worker_cls: type, *, devices: int, share: float, name: str, **kwargs: Any):
        return RayWorkerGroup(
            worker_cls,
            bundles=self.bundles(devices),
            device_share=share,
            use_gpu=self.use_gpu,
            name=name,
            kwargs={**kwargs, "device": self.device},
        )

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self.placement_groups:
            try:
                remove_placement_group(group)
            except Exception as error:  # Ray already gone
                log.debug("placement group removal: %s", error)
        self.placement_groups = []
        if self.connected and ray.is_initialized():
            ray.shutdown()  # stops the Ray it started; only disconnects from a cluster it joined
            self.connected = False

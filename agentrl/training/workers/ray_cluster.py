"""The Ray side of the `ray` backend: start (or join) Ray, reserve the devices, build the worker groups.

One placement group holds a bundle per device (`trainer.n_gpus_per_node x trainer.nnodes`). The policy
workers take the first `resource_pool_config.actor_rollout_gpus` bundles and the critic workers the first
`resource_pool_config.critic_gpus` (both default to every device); where they share a device each takes
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


class RayCluster:
    """Owns the Ray runtime (when it started it) and the placement group of the run's devices."""

    def __init__(self, config: AgentRLConfig, device: str) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.config = config
        self.device = device
        self.use_gpu = device.startswith("cuda")
        trainer = config.trainer
        self.world = trainer.n_gpus_per_node * trainer.nnodes
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            resources = {"num_gpus": self.world} if self.use_gpu else {}
            ray.init(
                num_cpus=max(self.world, os.cpu_count() or 1),
                include_dashboard=False,
                log_to_driver=True,
                **resources,
            )
        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        strategy = "STRICT_PACK" if trainer.nnodes == 1 else "PACK"
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world)], strategy=strategy)
        ready = self.placement_group.ready()
        try:
            ray.get(ready, timeout=120)
        except Exception as error:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not reserve {self.world} x {bundle} (trainer.n_gpus_per_node x trainer.nnodes); "
                f"cluster resources: {ray.cluster_resources()}"
            ) from error

    def worker_group(self, worker_cls: type, *, devices: int, share: float, name: str, **kwargs: Any):
        return RayWorkerGroup(
            worker_cls,
            placement_group=self.placement_group,
            bundle_indices=list(range(devices)),
            device_share=share,
            use_gpu=self.use_gpu,
            name=name,
            kwargs={**kwargs, "device": self.device},
        )

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception as error:  # Ray already gone
                log.debug("placement group removal: %s", error)
            self.placement_group = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()

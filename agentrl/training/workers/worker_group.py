"""Worker groups: where workers live. The controller calls worker methods by name through one interface.

`local` keeps one worker in the controller process (one device; the embedded default). `ray` starts one Ray
actor per device, placed by a placement group, with torch.distributed initialised inside (NCCL on GPU, gloo
on CPU) before the worker is built, so the worker shards its models with FSDP2. The controller's code does
not change with where its workers run: `call` runs a method on every worker, `dispatch` splits a batch over
them by data-parallel rank and puts the results back together.
"""

from __future__ import annotations

import logging
import os
import socket
from abc import ABC, abstractmethod
from typing import Any

from agentrl.rollout.admin_auth import ADMIN_TOKEN_ENV, process_admin_token
from agentrl.training.update.assembly import TrainBatch
from agentrl.training.workers.dispatch import gather_outputs, split_batch

log = logging.getLogger(__name__)


class WorkerGroup(ABC):
    """A set of identical workers; `call` runs one of their methods on each and returns the results."""

    size: int = 1

    @abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `worker.<method>(*args, **kwargs)` on every worker, in rank order."""

    def call_first(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a method on every worker and return rank 0's result (what data-parallel methods agree on)."""
        return self.call(method, *args, **kwargs)[0]

    def dispatch(self, method: str, batch: TrainBatch, *, balance_tokens: bool = False) -> Any:
        """Run `method(shard)` on every rank with its share of `batch`; tensors come back in batch order.

        Methods that return metrics reduce them over ranks themselves; rank 0's copy is returned.
        """
        shards, origin = split_batch(batch, self.size, balance_tokens)
        outputs = self._call_each(method, shards)
        return gather_outputs(outputs, origin, len(batch))

    @abstractmethod
    def _call_each(self, method: str, per_rank_args: list[Any]) -> list[Any]:
        """Run `method(per_rank_args[rank])` on every rank."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold."""


class LocalWorkerGroup(WorkerGroup):
    """One worker in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def _call_each(self, method: str, per_rank_args: list[Any]) -> list[Any]:
        return [getattr(self.worker, method)(per_rank_args[0])]

    def shutdown(self) -> None:
        stop = getattr(self.worker, "shutdown", None)
        if stop is not None:
            stop()


class WorkerHost:
    """What runs inside each Ray actor: names a rendezvous (rank 0), joins the process group, builds the
    worker, then serves calls."""

    def __init__(self) -> None:
        self.worker = None

    def rendezvous(self) -> str:
        """`tcp://<this node's IP>:<a free port>` for the group's store: rank 0 calls it, on its own node."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(
        self,
        worker_cls: type,
        rank: int,
        world_size: int,
        init_method: str,
        kwargs: dict[str, Any],
        ranks_on_node: int,
    ) -> None:
        import torch

        from agentrl.training.parallel.distributed import init_worker_process_group

        # Ray starts actors with OMP_NUM_THREADS=1; each rank gets its share of its node's cores instead (on GPU
        # too: with parameter offload the optimizer step and gradient accumulation run on the CPU).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))
        init_worker_process_group(rank, world_size, init_method, kwargs.get("device", "cpu"))
        self.worker = worker_cls(**kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def shutdown(self) -> None:
        from agentrl.training.parallel.distributed import destroy_process_group

        stop = getattr(self.worker, "shutdown", None)
        if stop is not None:
            stop()
        destroy_process_group()


class RayWorkerError(RuntimeError):
    """A Ray worker failed or died; the message names the rank and the method."""


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per device, rank r on `bundles[r]` (a placement group and a bundle index in it).

    Rank 0 names the rendezvous address from its own node, so the group forms across nodes; the group is
    built (process group joined, worker constructed) when the constructor returns, or it raises naming the rank.
    """

    def __init__(
        self,
        worker_cls: type,
        *,
        bundles: list[tuple[Any, int]],
        device_share: float,
        use_gpu: bool,
        name: str,
        kwargs: dict[str, Any],
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        self.size = len(bundles)
        host_cls = ray.remote(WorkerHost)
        self.actors = [
            host_cls.options(
                num_cpus=device_share if not use_gpu else 0,
                num_gpus=device_share if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
                # one admin token for the whole run: the controller's pool calls the workers' servers
                runtime_env={"env_vars": {ADMIN_TOKEN_ENV: process_admin_token()}},
            ).remote()
            for group, index in bundles
        ]
        try:
            [init_method] = self._wait("rendezvous", [self.actors[0].rendezvous.remote()])
            on_node = [sum(other is group for other, _ in bundles) for group, _ in bundles]
            starts = [
                actor.start.remote(worker_cls, rank, self.size, init_method, kwargs, on_node[rank])
                for rank, actor in enumerate(self.actors)
            ]
            self._wait("start", starts)
        except BaseException:
            for actor in self.actors:  # a joined cluster outlives this run: leave no actor behind
                ray.kill(actor)
            raise

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        return self._wait("node_id", [actor.node_id.remote() for actor in self.actors])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._wait(method, [actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def _call_each(self, method: str, per_rank_args: list[Any]) -> list[Any]:
        refs = [actor.call.remote(method, arg) for actor, arg in zip(self.actors, per_rank_args, strict=True)]
        return self._wait(method, refs)

    def _wait(self, method: str, refs: list[Any]) -> list[Any]:
        """Results in rank order; the first rank that fails or dies raises at once, not after its peers
        time out waiting for it in a collective."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as error:
                rank = refs.index(done[0])
                raise RayWorkerError(
                    f"{self.name} worker rank {rank} failed in {method}: {type(error).__name__}: "
                    f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
                ) from error
        return ray.get(refs)

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=60)
        except Exception as error:  # a dead worker cannot shut down; kill it below
            log.warning("%s workers did not shut down cleanly: %s", self.name, error)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _free_port() -> int:
    """A port free on every interface of this node at the time of the call."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]

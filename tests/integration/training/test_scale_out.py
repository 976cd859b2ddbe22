"""Scale-out on CPU: a real two-node Ray cluster on this machine, and two rollout replicas serving one run.

A two-turn flow (the second call re-sends the first reply) makes every rollout a multi-call session, so routing
can be checked at the run level: each policy worker serves its own embedded engine, the pool routes sessions
over them, and every call of a session must land on the server of its first call. The reward is a hash of the
answer, so groups carry signal from random weights and the first update's numbers mean something.

The one-node run (2 workers on one Ray node) is the baseline: the two-node run (one worker on each node of a
`ray.cluster_utils.Cluster`, joined through RAY_ADDRESS) must place a worker on each node and reproduce its
first step, since the gateway derives each call's seed from (trainer.seed, session, call).
"""

from __future__ import annotations

import asyncio
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from _short_run import short_run_overrides

from agentrl import AgentFlow, EvalOutput, Evaluator
from agentrl.config import load_config
from agentrl.data import load_dataset_rows
from agentrl.runs.rollout_files import read_rollouts
from agentrl.training.controller import Controller

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
FIRST_STEP_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/full-score/mean")


class AskTwice(AgentFlow):
    """Two model calls in one session: answer, then the same conversation plus the reply and 'Again?'.

    Sessions wait 0-0.3 s (by session id) before their second call, so second calls reach the pool in another
    order than first calls: a router that picked the least-loaded server per call, forgetting the session's
    server, would move sessions (a per-call router in first-call order would land them where they were)."""

    async def run(self, task, ctx):
        messages = [dict(m) for m in task["prompt"]]
        first = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
        await asyncio.sleep((zlib.crc32(ctx.session_id.encode()) % 7) * 0.05)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "Again?"},
        ]
        second = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
        return second.choices[0].message.content


class HashReward(Evaluator):
    """A reward in [0, 1] from the answer's text: different answers of a group score differently."""

    def evaluate(self, task, episode):
        return EvalOutput(reward=(zlib.crc32((episode.answer or "").encode()) % 4) / 3)


@dataclass
class RunRecord:
    metrics: dict[str, float]
    node_ids: list[str]
    server_requests: dict[str, int]
    """Calls the pool sent to each server URL over the run."""
    session_servers: list[list[str]]
    """For each saved episode, the server of each of its calls."""


def _run(run_dir: Path, *extra: str) -> RunRecord:
    config = load_config(
        short_run_overrides(run_dir, "trainer.backend=ray", *extra),
        config_path=REPO / "configs" / "arithmetic.yaml",
    )
    rows = load_dataset_rows(config.data.train_files)
    controller = Controller(config, AskTwice(), HashReward(), rows, None)
    try:
        controller.setup()
        node_ids = controller.policy.node_ids()
        metrics = controller.train()
        servers = {s.url: s.requests for s in controller.stack.pool.servers}
    finally:
        controller.close()
    episodes = read_rollouts(run_dir, step=1)
    calls = [[s["server"] for t in e["trajectories"] for s in t["steps"]] for e in episodes]
    return RunRecord(metrics, node_ids, servers, calls)


def _ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "raylet" in line or "gcs_server" in line]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> RunRecord:
    """Two policy workers on one local Ray node (Ray started by the run)."""
    return _run(tmp_path_factory.mktemp("one_node"), "trainer.n_gpus_per_node=2")


def test_two_rollout_replicas_serve_one_run_with_sticky_sessions(one_node):
    run = one_node
    assert len(set(run.node_ids)) == 1 and len(run.node_ids) == 2
    assert len(run.server_requests) == 2, f"one embedded server per policy worker: {run.server_requests}"
    assert len(run.session_servers) == 16 and all(len(calls) == 2 for calls in run.session_servers)
    for calls in run.session_servers:
        assert len(set(calls)) == 1, f"a session's calls went to more than one server: {calls}"
    used = {calls[0] for calls in run.session_servers}
    assert used == set(run.server_requests), "both replicas should serve sessions"
    # Every call the pool routed is a saved step (no retries, no calls outside sessions), server by server.
    per_server = {url: sum(c.count(url) for c in run.session_servers) for url in run.server_requests}
    assert per_server == run.server_requests
    assert run.metrics["rollout/servers"] == 2
    assert run.metrics["rollout/server_requests_min"] == min(per_server.values()) > 0
    assert run.metrics["rollout/server_requests_max"] == max(per_server.values())


def test_a_two_node_ray_cluster_places_a_worker_on_each_node_and_matches_one_node(
    tmp_path, one_node, monkeypatch
):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        nodes = {cluster.head_node.node_id, *(node.node_id for node in cluster.worker_nodes)}
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        run = _run(tmp_path, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")
    finally:
        cluster.shutdown()
    assert len(nodes) == 2 and set(run.node_ids) == nodes, f"workers on {run.node_ids}, nodes {nodes}"
    assert len(run.server_requests) == 2 and all(n > 0 for n in run.server_requests.values())
    for calls in run.session_servers:
        assert len(set(calls)) == 1, calls
    assert one_node.metrics["actor/grad_norm"] > 0
    for key in FIRST_STEP_KEYS:
        assert run.metrics[key] == pytest.approx(one_node.metrics[key], rel=1e-4, abs=1e-7), key
    for key in ("response_length/mean", "batch/rows"):
        assert run.metrics[key] == one_node.metrics[key], key
    assert not _ray_processes(), "Ray was left running after the cluster shut down"

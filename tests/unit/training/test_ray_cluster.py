"""Which Ray nodes a multi-node run takes: enough of the device resource each, the driver's node first."""

from __future__ import annotations

import pytest

from agentrl.training.workers.ray_cluster import pick_nodes


def _node(node_id: str, cpus: float, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus}}


def test_the_driver_node_comes_first_then_node_ids_in_order():
    nodes = [_node("c", 4), _node("a", 4), _node("b", 4)]
    assert pick_nodes(nodes, 2, 2, "CPU", first="b") == ["b", "a"]


def test_small_and_dead_nodes_are_skipped():
    nodes = [_node("a", 1), _node("b", 2, alive=False), _node("c", 2), _node("d", 8)]
    assert pick_nodes(nodes, 2, 2, "CPU", first="a") == ["c", "d"]


def test_too_few_nodes_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"trainer.nnodes=2 needs 2 Ray nodes with 2 GPU each.*has 1"):
        pick_nodes([_node("a", 8) | {"Resources": {"GPU": 8}}, _node("b", 8)], 2, 2, "GPU", first="a")

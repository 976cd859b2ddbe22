"""Graph launches and timing marks through the CUDA driver (`_graph_launch.py`): the same results as torch's
replay, a graph that draws torch random numbers kept on torch's replay, and marks that time the device's work.
(That the driver's calls keep the GIL is `ctypes.PyDLL`'s contract; what it changes in the engine is measured in
docs/benchmarks.md, "Graph launches that keep the GIL".)"""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.engines._graph_launch import GraphLauncher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]


def _captured(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def test_a_graph_without_torch_randomness_goes_through_the_driver_with_replays_results():
    launcher = GraphLauncher(torch.device("cuda"))
    assert launcher.through_driver
    x, w = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    graph, out = _captured(lambda: torch.relu(x @ w) + 1)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        launcher.launch(graph)
        torch.cuda.synchronize()
        assert torch.allclose(out, torch.relu(x @ w) + 1, atol=1e-3)
    assert launcher._direct[graph] is True


def test_a_graph_drawing_torch_random_numbers_keeps_torchs_replay():
    launcher = GraphLauncher(torch.device("cuda"))
    graph, out = _captured(lambda: torch.rand(1024, device="cuda"))
    draws = []
    for _ in range(3):
        launcher.launch(graph)
        draws.append(out.clone())
    assert launcher._direct[graph] is False
    # launched without torch's offsets it would draw the same numbers again
    assert not torch.equal(draws[1], draws[2])


def test_marks_around_a_launch_time_the_graphs_device_work():
    launcher = GraphLauncher(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")

    def work():
        b = a
        for _ in range(8):
            b = b @ a
        return b

    graph, _ = _captured(work)
    launcher.launch(graph)
    start = launcher.mark()
    launcher.launch(graph)
    end = launcher.mark()
    end.synchronize()
    by_marks = start.elapsed_time(end)
    launcher.release(start, end)
    reference_start = torch.cuda.Event(enable_timing=True)
    reference_end = torch.cuda.Event(enable_timing=True)
    reference_start.record()
    graph.replay()
    reference_end.record()
    reference_end.synchronize()
    by_torch = reference_start.elapsed_time(reference_end)
    assert 0.5 * by_torch < by_marks < 2 * by_torch, (by_marks, by_torch)
    again = launcher.mark()  # a released event is recorded again, not a new one made
    assert again is end or again is start

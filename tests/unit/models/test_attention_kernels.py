"""The attention-kernel switches: a training worker leaves cuDNN's attention out on CUDA only, and a graph
capture has it allowed, with the process's switch restored afterwards (also when the capture fails)."""

from __future__ import annotations

import pytest
import torch

from agentrl.models.attention_kernels import cudnn_attention_for_capture, skip_cudnn_attention


@pytest.fixture
def cudnn_switch():
    allowed = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(allowed)


def test_a_cpu_worker_leaves_the_switch_alone(cudnn_switch):
    torch.backends.cuda.enable_cudnn_sdp(True)
    skip_cudnn_attention(torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_capture_allows_cudnn_attention_and_restores_the_switch(cudnn_switch):
    torch.backends.cuda.enable_cudnn_sdp(False)  # what a training worker on CUDA leaves
    with cudnn_attention_for_capture():
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError, match="capture failed"), cudnn_attention_for_capture():
        raise RuntimeError("capture failed")
    assert not torch.backends.cuda.cudnn_sdp_enabled()

"""Fingerprints and in-place weight loading."""

import pytest
import torch

from agentrl.rollout.engines._weights import fingerprint_state_dict, load_weights_in_place, read_state_dict


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_fingerprint_equal_for_equal_values_and_dtype_independent():
    model = _model()
    state = model.state_dict()
    copy = {k: v.clone() for k, v in state.items()}
    assert fingerprint_state_dict(state) == fingerprint_state_dict(copy)
    exact_bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    upcast = {k: v.float() for k, v in exact_bf16.items()}
    assert fingerprint_state_dict(exact_bf16) == fingerprint_state_dict(upcast)


def test_fingerprint_changes_with_any_value_or_name():
    state = _model().state_dict()
    base = fingerprint_state_dict(state)
    changed = {k: v.clone() for k, v in state.items()}
    changed["1.bias"][1] += 1e-6
    assert fingerprint_state_dict(changed) != base
    renamed = {("x." + k): v for k, v in state.items()}
    assert fingerprint_state_dict(renamed) != base


def test_fingerprint_samples_large_tensors():
    big = {"w": torch.arange(10_000, dtype=torch.float32)}
    other = {"w": big["w"].clone()}
    other["w"][0] = -1.0  # the first element is always sampled
    assert fingerprint_state_dict(big) != fingerprint_state_dict(other)


def test_load_weights_in_place_keeps_storage_and_checks_names_and_shapes(tmp_path):
    model = _model()
    pointer = model[0].weight.data_ptr()
    load_weights_in_place(model, {"0.weight": torch.ones(3, 4)})
    assert model[0].weight.data_ptr() == pointer
    assert torch.equal(model[0].weight, torch.ones(3, 4))
    with pytest.raises(ValueError, match="unknown parameter name 'nope'"):
        load_weights_in_place(model, {"nope": torch.ones(1)})
    with pytest.raises(ValueError, match=r"0.bias has shape \(5,\)"):
        load_weights_in_place(model, {"0.bias": torch.ones(5)})

    from safetensors.torch import save_file

    save_file({"0.bias": torch.full((3,), 2.0)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(read_state_dict(str(tmp_path))["0.bias"], torch.full((3,), 2.0))
    assert set(read_state_dict(str(tmp_path / "model.safetensors"))) == {"0.bias"}
    with pytest.raises(ValueError, match="neither a .safetensors file"):
        read_state_dict(str(tmp_path / "missing"))

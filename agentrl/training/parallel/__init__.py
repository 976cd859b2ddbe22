"""Spreading a model over devices: process groups, FSDP2, full/sharded model state, weight sync to engines."""

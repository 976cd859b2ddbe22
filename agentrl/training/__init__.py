"""The training core (verl's single controller and workers): `controller.py` runs one step after another.

`workers/` holds the policy and critic workers, the worker group with its local and Ray backends, and how a
batch is split among them; `update/` the maths on a batch (row assembly, advantages, forward, PPO update,
packing); `parallel/` what spreads a model over devices (process groups, FSDP2, model state, weight sync to
the inference engines). "Engine" in this project means an inference engine (`agentrl/rollout/engines/`).
"""

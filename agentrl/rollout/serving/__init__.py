"""Serving the policy: one interface (`PolicyServing`) over the embedded engine and vLLM servers.

A policy worker starts one (`start_policy_serving`, from `actor_rollout_ref.rollout.name`), pushes trained
weights through it, checks what it serves, and frees its memory while training; the controller only sees its
URLs. `base.py` holds the interface, `embedded.py` and `vllm.py` the two implementations. (The inference engines
themselves live in `rollout/engines/`; `trainer.backend` picks where workers run, local or Ray.)
"""

from agentrl.rollout.serving.base import PolicyServing, ProbeResult, probe_server, start_policy_serving

__all__ = ["PolicyServing", "ProbeResult", "probe_server", "start_policy_serving"]

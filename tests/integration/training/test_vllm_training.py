"""GRPO through `AgentTrainer` with `actor_rollout_ref.rollout.name=vllm`: vLLM CPU servers generate, the
trainer pushes its weights into them after every step, and nothing of vLLM outlives the run; with the local
backend and with the policy worker in a Ray actor (`trainer.backend=ray`).

`rollout/logprob_diff_max` compares the log-probs vLLM reported while generating with the trainer's own
for the same tokens: with float32 on both sides it is ~1e-6 when vLLM serves the trainer's weights, while
one Adam step at lr 1e-3 moves tiny:qwen2's log-probs by far more than the bound, so stale weights fail it.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from agentrl import AgentTrainer, EvalOutput, SingleTurnChatFlow, evaluator
from agentrl.models import load_causal_lm, resolve_model_path
from agentrl.training.parallel.weight_sync import max_logprob_gap, score_tokens

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LOGPROB_BOUND = 1e-3  # float32 vLLM vs float32 transformers; see agentrl/training/parallel/weight_sync.py

ROWS = [
    {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": i},
    }
    for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8)])
]


@evaluator
def answer_length(task, episode):
    """A reward that differs within a group (sampled answers differ in length), so the policy moves."""
    return EvalOutput(reward=float(len(episode.answer or "")))


def _processes_with_env(marker: str) -> list[int]:
    """PIDs whose environment holds `marker` (every vLLM process of this run inherits it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if marker.encode() in environ.split(b"\0"):
                pids.append(int(entry))
    return pids


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_grpo_generates_with_vllm_serving_the_trained_weights(tmp_path, monkeypatch, backend):
    """Also under `trainer.backend=ray`: the policy worker is a Ray actor that launches and feeds vLLM itself."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build the vLLM environment with `make setup-vllm`")
    marker = f"AGENTRL_VLLM_TRAINING_TEST={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("=", 1))  # the launcher passes our environment on to vLLM
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.vllm.python={VLLM_PYTHON}",
        "actor_rollout_ref.rollout.vllm.dtype=float32",
        "actor_rollout_ref.rollout.vllm.startup_timeout=240",
        "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "data.shuffle=false",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path}",
        f"trainer.backend={backend}",
    ]

    result = AgentTrainer(
        flow=SingleTurnChatFlow(), evaluator=answer_length, train_dataset=ROWS, config=overrides
    ).train()

    assert result.global_step == 2
    history = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = [r for r in history if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["batch/rows"] > 0
        assert record["rollout/logprob_diff_max"] < LOGPROB_BOUND, record["rollout/logprob_diff_max"]
        assert record["rollout/sync_probe_logprob_diff"] < LOGPROB_BOUND
    # The start-up sync is version 1; each step pushes one more, and the actor did move.
    assert [r["rollout/policy_version"] for r in steps] == [2.0, 3.0]
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    # ...by enough that serving stale weights would break the bound above.
    prompt, tokens = list(range(10, 20)), list(range(20, 30))
    before = score_tokens(load_causal_lm(resolve_model_path("tiny:qwen2")), prompt, tokens)
    after = score_tokens(load_causal_lm(str(result.export_dir)), prompt, tokens)
    assert max_logprob_gap(before, after) > 10 * LOGPROB_BOUND
    # Weights were reloaded through vLLM, three times; the weight folders are gone with the servers.
    logs = list((tmp_path / "vllm_logs").glob("vllm_*.log"))
    assert len(logs) == 1 and logs[0].read_text().count("POST /collective_rpc") == 3
    assert not (tmp_path / "vllm_weights").exists()
    assert _processes_with_env(marker) == [], "vLLM processes outlived the run"

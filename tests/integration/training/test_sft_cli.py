"""`agentrl sft`: the warm start alone, written as a Hugging Face folder that loads and answers better."""

import subprocess
import sys

import pytest
import torch

from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path

pytestmark = pytest.mark.slow


def test_agentrl_sft_writes_a_model_that_fits_the_answers_better(tmp_path):
    command = [
        sys.executable, "-m", "agentrl.cli", "sft", "--config", "configs/arithmetic.yaml",
        "actor_rollout_ref.model.path=tiny:qwen2-mini", "sft.max_steps=60", "sft.batch_size=16",
        f"trainer.default_local_dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved to" in done.stdout
    out = tmp_path / "sft_model"
    tuned, base = load_causal_lm(str(out)), load_causal_lm(resolve_model_path("tiny:qwen2-mini"))
    tokenizer = load_tokenizer(str(out))
    messages = [{"role": "user", "content": "What is 3 + 4? Answer with the number only."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt + "7<|im_end|>", return_tensors="pt", add_special_tokens=False).input_ids
    prompt_len = len(tokenizer(prompt, add_special_tokens=False).input_ids)

    def answer_loss(model):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, prompt_len - 1 : -1]
        return torch.nn.functional.cross_entropy(logits, ids[0, prompt_len:]).item()

    assert answer_loss(tuned) < answer_loss(base) - 1.0

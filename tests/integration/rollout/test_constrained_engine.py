"""Constrained rows inside the embedded engine's batch: they follow their grammar, greedy takes the
best allowed token, the grammar ends them whatever `min_tokens` / `ignore_eos` say, and rows without a
constraint that share their steps draw exactly what they draw alone."""

import asyncio
import copy
import json

import pytest
import torch

from agentrl.rollout.chat import parse_tool_calls, render_chat
from agentrl.rollout.engines.constraints import GrammarCompiler, build_constraint, fill_bitmasks
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "enum": ["alpha", "beta", "gamma"]}},
                "required": ["key"],
            },
        },
    }
]
NAMED = {"type": "function", "function": {"name": "lookup"}}


@pytest.fixture
def engine(model, tokenizer):
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=16, max_model_len=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return render_chat(tokenizer, [{"role": "user", "content": "Look up beta."}], tools=TOOLS)


def _keys(outputs) -> list[str]:
    keys = []
    for out in outputs:
        parsed = parse_tool_calls(out.text)
        assert out.finish_reason == "stop" and parsed.error is None, out.text
        (call,) = parsed.tool_calls
        assert call["function"]["name"] == "lookup"
        keys.append(json.loads(call["function"]["arguments"])["key"])
    return keys


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine, prompt):
    free = SamplingParams(temperature=1.0, max_tokens=24, seed=11, n=2)
    forced = SamplingParams(temperature=1.0, max_tokens=64, seed=5, n=4)
    constraint = build_constraint(TOOLS, NAMED, None)

    async def run():
        alone = await engine.generate(prompt, free)
        together = await asyncio.gather(
            engine.generate(prompt, free), engine.generate(prompt, forced, constraint=constraint)
        )
        return alone, together

    alone, (free_again, constrained) = asyncio.run(run())
    assert [o.token_ids for o in free_again] == [o.token_ids for o in alone]
    assert set(_keys(constrained)) <= {"alpha", "beta", "gamma"}


def test_greedy_takes_the_best_allowed_token_at_every_step(engine, model, tokenizer, prompt):
    constraint = build_constraint(TOOLS, NAMED, None)
    (out,) = asyncio.run(
        engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64), constraint=constraint)
    )
    _keys([out])
    (matcher,) = GrammarCompiler(tokenizer, engine.vocab_size, engine._detok.eos_token_ids).start(
        constraint, 1
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    for step, token in enumerate(out.token_ids):
        words = fill_bitmasks([matcher], engine.vocab_size)[0]
        allowed = torch.tensor(
            [(int(words[t // 32]) >> (t % 32)) & 1 for t in range(engine.vocab_size)]
        ).bool()
        expected = int(torch.argmax(logits[step].masked_fill(~allowed, float("-inf"))))
        assert token == expected, step
        assert matcher.consume_token(token)
    raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), raw, atol=1e-4)


def test_the_grammar_ends_a_constrained_answer_despite_min_tokens_and_ignore_eos(engine, prompt):
    params = SamplingParams(temperature=1.0, max_tokens=120, min_tokens=100, ignore_eos=True, seed=2, n=3)
    outputs = asyncio.run(
        engine.generate(prompt, params, constraint=build_constraint(TOOLS, "required", None, False))
    )
    _keys(outputs)
    assert all(len(o.token_ids) < 100 and o.token_ids[-1] == 2 for o in outputs)

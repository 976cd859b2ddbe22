"""Attention that reads a shared prompt prefix once (`shared_prefix_attention.py`): which rows it groups, that it
is the plain attention in the decode step and in the packed prefill, and that the CPU engine's steps through it
still give a plain forward's logits, also after a row leaves and another prompt takes its slot."""

import torch
import torch.nn.functional as F

from agentrl.rollout.engines._prefix_cache import BLOCK_TOKENS, block_hashes
from agentrl.rollout.engines._slot_batch import SlotBatch
from agentrl.rollout.engines._slot_decode import decode_attention
from agentrl.rollout.engines.shared_prefix_attention import MIN_SHARED_TOKENS, plan_shared_prefix
from tests._random_qwen2 import random_qwen2

CPU = torch.device("cpu")


def _prompts(seed: int, shared: int, groups: int, rows_per_group: int, own: int) -> list[list[int]]:
    """`groups` x `rows_per_group` prompts: each group's rows begin with the same `shared` tokens, then `own` of
    their own."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(groups):
        prefix = torch.randint(0, 80, (shared,), generator=generator).tolist()
        prompts += [
            prefix + torch.randint(0, 80, (own,), generator=generator).tolist() for _ in range(rows_per_group)
        ]
    return prompts


def _plan(prompts: list[list[int]], slots: list[int] | None = None, step_slots: int | None = None):
    slots = slots if slots is not None else list(range(len(prompts)))
    hashes = [tuple(block_hashes(p)) for p in prompts]
    return plan_shared_prefix(slots, hashes, step_slots or max(slots) + 1, BLOCK_TOKENS, CPU)


def test_rows_are_grouped_by_the_prefix_that_saves_the_most_reading():
    """Two prompts' rows interleaved over the slots: two groups over the 128 shared tokens (not the 16 more two
    rows happen to share), each group's slots together, each slot finding itself in its group."""
    prompts = _prompts(seed=0, shared=128, groups=2, rows_per_group=3, own=40)
    prompts[1] = prompts[0][:144] + prompts[1][144:]  # rows 0 and 1 share one block more
    slots = [5, 1, 7, 0, 2, 6]
    plan = _plan(prompts, slots, step_slots=8)
    assert plan is not None and plan.length == 128
    groups = {frozenset(row) for row in plan.members.tolist()}
    assert groups == {frozenset({5, 1, 7}), frozenset({0, 2, 6})}
    flat = plan.members.view(-1)
    for slot in slots:
        assert flat[plan.member_of_slot[slot]] == slot
    assert set(plan.leaders.tolist()) <= set(slots)


def test_no_plan_when_sharing_would_not_pay_or_a_row_is_unknown():
    """Every row its own prompt (groups of one), a prefix under `MIN_SHARED_TOKENS`, a row whose prompt was not
    hashed (an image prompt, prefix caching off), a single row: the plain attention."""
    assert _plan(_prompts(seed=1, shared=0, groups=4, rows_per_group=1, own=200)) is None
    short = MIN_SHARED_TOKENS - BLOCK_TOKENS
    assert _plan(_prompts(seed=2, shared=short, groups=1, rows_per_group=4, own=100)) is None
    prompts = _prompts(seed=3, shared=128, groups=1, rows_per_group=4, own=20)
    hashes = [tuple(block_hashes(p)) for p in prompts]
    assert plan_shared_prefix([0, 1, 2, 3], hashes, 4, BLOCK_TOKENS, CPU) is not None
    assert plan_shared_prefix([0, 1, 2, 3], hashes[:3] + [()], 4, BLOCK_TOKENS, CPU) is None
    assert plan_shared_prefix([0], hashes[:1], 1, BLOCK_TOKENS, CPU) is None


def test_a_shorter_prefix_all_rows_share_wins_over_a_longer_one_of_a_few():
    """Four rows share 64 tokens and two of them 256: one group over 64 tokens (3 x 64 positions saved) is taken,
    since three groups over 256 would leave groups of fewer than two rows on average."""
    prompts = _prompts(seed=4, shared=64, groups=1, rows_per_group=4, own=300)
    prompts[1] = prompts[0][:256] + prompts[1][256:]
    plan = _plan(prompts)
    assert plan is not None and plan.length == 64 and plan.members.shape[0] == 1


def test_shared_attention_is_the_plain_attention():
    """Slots whose first 96 positions hold one of two prefixes, an idle slot beside them, rows of different
    lengths: the same output as attending over each slot's own cache, to float64 rounding."""
    torch.manual_seed(0)
    slots, kv_heads, rows, head_dim, length, reach = 7, 2, 3, 16, 160, 150
    keys = torch.randn(slots, kv_heads, length, head_dim, dtype=torch.float64)
    values = torch.randn(slots, kv_heads, length, head_dim, dtype=torch.float64)
    members = {0: [0, 2, 3], 1: [1, 4, 6]}  # slot 5 runs nothing
    for group in members.values():
        keys[group[1:], :, :96] = keys[group[0], :, :96]
        values[group[1:], :, :96] = values[group[0], :, :96]
    prompts = [None] * slots
    base = _prompts(seed=5, shared=96, groups=2, rows_per_group=1, own=8)
    for g, group in members.items():
        for slot in group:
            prompts[slot] = base[g]
    running = [slot for slot in range(slots) if slot != 5]
    plan = plan_shared_prefix(
        running, [tuple(block_hashes(prompts[s])) for s in running], slots, BLOCK_TOKENS, CPU
    )
    assert plan is not None and plan.length == 96
    positions = torch.tensor([120, 130, 100, 149, 110, 159, 140])
    visible = (torch.arange(reach) <= positions[:, None])[:, None, None, :]
    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill_(~visible, float("-inf"))
    query = torch.randn(slots, kv_heads, rows, head_dim, dtype=torch.float64)
    shared = plan.attend(query, keys, values, mask, scale=0.25)
    plain = decode_attention(query, keys[:, :, :reach], values[:, :, :reach], mask, 0.25)
    assert torch.isfinite(shared).all()
    torch.testing.assert_close(shared[running], plain[running], atol=1e-12, rtol=0)


def _reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_the_engines_decode_steps_through_a_shared_prefix_give_a_plain_forwards_logits():
    """Float32 on the CPU: a prompt sent as `n=3` and another's three siblings sent one by one (a GRPO group each:
    every row shares its whole prompt, 112 of its 126 tokens in whole blocks), decoded for a few steps; then one
    row leaves and a prompt of its own takes the freed slot, which must not read the group's prefix: each step's
    logits equal a plain forward's."""
    model = random_qwen2(vocab_size=80)
    batch = SlotBatch(model, max_slots=8, max_model_len=256, cuda_graphs=False)
    prompts = _prompts(seed=6, shared=96, groups=2, rows_per_group=1, own=30)
    siblings = [prompts[1]] * 3
    admitted = [prompts[0], *siblings]
    batch.admit(admitted, [3, 1, 1, 1], reserve=200, hashes=[block_hashes(p) for p in admitted])
    sequences = [list(prompts[0]) for _ in range(3)] + [list(p) for p in siblings]
    generator = torch.Generator().manual_seed(7)

    def step_and_check() -> None:
        tokens = torch.randint(0, 80, (len(sequences),), generator=generator).tolist()
        logits = batch.decode(tokens)
        for row, token in enumerate(tokens):
            sequences[row].append(token)
            torch.testing.assert_close(logits[row], _reference(model, sequences[row]), atol=1e-5, rtol=0)

    for _ in range(3):
        step_and_check()
    plan = batch._shared[1] if batch._shared is not None else None
    assert plan is not None and plan.length == 112 and plan.members.shape == (2, 3)
    batch.keep(
        [0, 1, 2, 3, 4]
    )  # the last sibling leaves: the newcomer takes its slot, the rows their slots again
    del sequences[5]
    newcomer = _prompts(seed=8, shared=0, groups=1, rows_per_group=1, own=126)[0]
    batch.admit([newcomer], [1], reserve=200, hashes=[block_hashes(newcomer)])
    sequences.append(list(newcomer))
    for _ in range(3):
        step_and_check()


def test_rows_admitted_under_other_weights_do_not_share():
    """A weight change between two admissions of the same prompt: the later rows hold keys of the new weights,
    so each admission's rows read their own group's copy, never the other's."""
    model = random_qwen2(vocab_size=80)
    batch = SlotBatch(model, max_slots=8, max_model_len=256, cuda_graphs=False)
    prompt = _prompts(seed=9, shared=0, groups=1, rows_per_group=1, own=100)[0]
    batch.admit([prompt], [2], reserve=200, hashes=[block_hashes(prompt)])
    batch.forget_prefixes()  # what the engine calls after every weight update
    batch.admit([prompt], [2], reserve=200, hashes=[block_hashes(prompt)])
    batch.decode([1, 2, 3, 4])
    plan = batch._shared[1] if batch._shared is not None else None
    assert plan is not None
    groups = {frozenset(row) for row in plan.members.tolist()}
    assert groups == {frozenset(batch._row_slots[:2]), frozenset(batch._row_slots[2:])}


def test_shared_prefill_attention_is_the_plain_attention():
    """A packed prefill's rows (their slots out of order, groups of 3, 2 and 1 over a 64-position prefix, 4 to 12
    query rows each past it, the padded query rows of the shorter ones included): the same output as attending
    over each row's own slot under the causal mask, to float64 rounding."""
    torch.manual_seed(1)
    slots, kv_heads, head_dim, length = 9, 2, 16, 128
    keys = torch.randn(slots, kv_heads, length, head_dim, dtype=torch.float64)
    values = torch.randn(slots, kv_heads, length, head_dim, dtype=torch.float64)
    row_slots = torch.tensor([7, 2, 5, 0, 8, 3])
    starts = [70, 64, 96, 80, 64, 100]
    group_of_row = [0, 1, 0, 2, 1, 0]
    base = _prompts(seed=10, shared=64, groups=3, rows_per_group=1, own=0)
    for row, group in enumerate(group_of_row):
        leader = row_slots[group_of_row.index(group)]
        keys[row_slots[row], :, :64] = keys[leader, :, :64]
        values[row_slots[row], :, :64] = values[leader, :, :64]
    hashes = [tuple(block_hashes(base[group])) for group in group_of_row]
    plan = plan_shared_prefix(list(range(6)), hashes, 6, BLOCK_TOKENS, CPU)
    assert plan is not None and plan.length == 64 and sorted(plan.sizes) == [1, 2, 3]
    widest, groups = 12, 2
    reach = max(starts) + widest
    positions = torch.tensor(starts)[:, None] + torch.arange(widest)
    visible = (torch.arange(reach) <= positions[:, :, None]).repeat_interleave(groups, dim=1).unsqueeze(1)
    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill_(~visible, float("-inf"))
    query = torch.randn(6, kv_heads, groups * widest, head_dim, dtype=torch.float64)
    shared = plan.attend_prefill(query, keys, values, mask[..., 64:], 0.25, row_slots)
    own_keys, own_values = keys[row_slots, :, :reach], values[row_slots, :, :reach]
    plain = F.scaled_dot_product_attention(query, own_keys, own_values, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(shared, plain, atol=1e-12, rtol=0)


def test_the_engines_prefill_over_parked_shared_prefixes_gives_a_plain_forwards_logits():
    """Float32 on the CPU, the serving benchmark's shape in small: two prompts' 96-token prefixes parked by
    earlier requests, then six prompts that begin with them admitted together (copies of the parked prefix, then
    a block their group shares but no slot holds, then 8 tokens of their own): one packed forward reads each
    parked prefix once a group (only what every row holds: the shared block is computed in this forward, under
    the causal mask), and every row's first logits, and the decode step after, equal a plain forward's."""
    model = random_qwen2(vocab_size=80)
    batch = SlotBatch(model, max_slots=8, max_model_len=256, cuda_graphs=False)
    earlier = _prompts(seed=11, shared=96, groups=2, rows_per_group=1, own=10)
    batch.admit(earlier, [1, 1], reserve=200, hashes=[block_hashes(p) for p in earlier])
    batch.keep([], {0: earlier[0], 1: earlier[1]})  # parked, as finished requests are
    generator = torch.Generator().manual_seed(12)
    blocks = [torch.randint(0, 80, (BLOCK_TOKENS,), generator=generator).tolist() for _ in range(2)]
    prompts = [
        earlier[i % 2][:96] + blocks[i % 2] + torch.randint(0, 80, (8,), generator=generator).tolist()
        for i in range(6)
    ]
    before = batch.counters["shared_prefix_prefills"]
    logits = batch.admit(prompts, [1] * 6, reserve=200, hashes=[block_hashes(p) for p in prompts])
    assert batch.counters["shared_prefix_prefills"] == before + 1
    assert batch.counters["prefix_hit_tokens"] >= 6 * 96
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _reference(model, prompt), atol=1e-5, rtol=0)
    tokens = torch.randint(0, 80, (6,), generator=generator).tolist()
    logits = batch.decode(tokens)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _reference(model, [*prompt, tokens[row]]), atol=1e-5, rtol=0)

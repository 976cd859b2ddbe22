"""The prefix index: longest exact match, take-over vs copy, least-recently-used eviction, running rows' prompts."""

from agentrl.rollout.engines._prefix_cache import BLOCK_TOKENS, PrefixCache, shared_prefixes


def test_the_longest_parked_prefix_wins_and_extends_past_block_edges():
    cache = PrefixCache()
    shared = list(range(40))
    cache.park(3, shared[:20])
    cache.park(5, shared + [99])
    match = cache.longest(shared + [7, 8])
    assert (match.slot, match.length, match.whole) == (5, 40, False)  # slot 5 holds 41 tokens; 40 match
    match = cache.longest(shared[:20] + [1, 2, 3])
    assert (match.slot, match.length, match.whole) in {(3, 20, True), (5, 20, False)}


def test_a_prompt_extending_everything_a_slot_holds_may_take_it_over():
    cache = PrefixCache()
    cache.park(1, list(range(33)))
    match = cache.longest(list(range(33)) + [500, 501])
    assert (match.slot, match.length, match.whole) == (1, 33, True)


def test_at_least_one_prompt_token_is_left_to_compute_and_short_matches_are_ignored():
    cache = PrefixCache()
    cache.park(0, list(range(48)))
    assert cache.longest(list(range(48))).length == 47
    assert cache.longest(list(range(BLOCK_TOKENS - 1)) + [1000] * 20) is None


def test_eviction_is_least_recently_used_and_spares_protected_slots():
    cache = PrefixCache()
    for slot in (0, 1, 2):
        cache.park(slot, [slot] * 20)
    cache.longest([0] * 25)  # slot 0 used: now the most recent
    assert cache.evict(protected={1}) == 2
    assert cache.evict(protected=set()) == 1
    assert len(cache) == 1 and cache.longest([1] * 25) is None
    assert cache.clear() == [0] and cache.longest([0] * 25) is None


def test_of_several_slots_holding_a_prefix_the_most_recently_used_is_chosen():
    cache = PrefixCache()
    for slot in (4, 7, 9):  # one shared block, then a block of each slot's own
        cache.park(slot, list(range(16)) + [100 + slot] * 16)
    shared_only = list(range(16)) + [500] * 5
    assert cache.longest(shared_only).slot == 9  # parked last
    assert cache.longest(list(range(16)) + [107] * 16 + [1]).slot == 7  # slot 7 used since
    assert cache.longest(shared_only).slot == 7


def test_prompts_of_one_admission_follow_the_first_that_shares_their_prefix():
    system = list(range(1000, 1050))  # 50 shared tokens: three whole blocks and two more
    prompts = {
        0: system + [1, 2],
        1: system + [3, 4, 5],
        2: [7] * 60,
        3: system[:20] + [9] * 40,
        4: system + [1, 2],
    }
    followers = shared_prefixes(prompts, {}, min_gain=16)
    # 4 equals 0 but for its last token, which stays to be computed; 3 shares only 20 tokens (one block plus four).
    assert followers == {1: (0, 50), 3: (0, 20), 4: (0, 51)}
    assert shared_prefixes(prompts, {}, min_gain=32) == {1: (0, 50), 4: (0, 51)}
    # a prompt that already starts past the shared part (a parked prefix of its own) follows nobody
    assert 1 not in shared_prefixes(prompts, {1: 40}, min_gain=16)


def test_a_running_rows_prompt_is_copied_from_but_never_taken_over_or_evicted():
    cache = PrefixCache()
    prompt = list(range(40))
    cache.hold(6, prompt)
    match = cache.longest(prompt + [7, 8])
    assert (match.slot, match.length, match.whole) == (6, 40, False)  # all it holds, yet only a copy
    assert len(cache) == 0 and cache.held(6) == 0 and cache.evict(protected=set()) is None
    cache.park(2, prompt[:20])
    assert cache.longest(prompt[:20] + [5]).slot == 2  # a parked holder is preferred: it may be taken over
    cache.park(6, prompt + [7])  # the row ended: its slot parks with what it generated
    assert cache.longest(prompt + [7, 9]).whole and cache.evict(protected={2}) == 6


def test_a_running_prompt_moves_with_its_row_and_goes_with_new_weights():
    cache = PrefixCache()
    cache.hold(9, list(range(32)))
    cache.park(1, [5] * 32)
    cache.relabel({9: 1, 1: 9})  # the row packed low, the parked slot moved up
    assert cache.longest(list(range(32)) + [1]).slot == 1 and cache.longest([5] * 33).slot == 9
    assert cache.new_weights(keep=1) == []  # indexed since the last change: both kept
    assert cache.new_weights() == [9]  # only the parked slot is freed; the row keeps its slot
    assert cache.longest(list(range(32)) + [1]) is None
    cache.hold(3, list(range(32)))
    assert cache.release(3) is False and cache.longest(list(range(32)) + [1]) is None  # ended without parking

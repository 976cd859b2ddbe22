"""Which cache slots hold the keys and values of which token prefixes: the embedded engine's prefix cache.

A finished sequence does not give its slot back at once: the slot is *parked* with the token ids whose keys
and values it holds (prompt + every sampled token but the last, which was never fed). The agent's next turn
extends exactly those tokens (the gateway continues sessions in token space), so its prompt finds the slot and
only the new tokens are prefilled; a prompt that shares a shorter prefix (a system prompt, a GRPO sibling)
copies that part into a fresh slot, as does a prompt whose prefix a running row's prompt holds (`hold`).
Parked slots are the first to go when a new row needs a slot (least recently used first), and when the weights
change every parked slot and running prompt is forgotten, so a prefix computed by other weights is never read;
asynchronous training may keep them for a bounded number of weight changes instead (`new_weights`).

Lookup is by chained hashes of 16-token blocks (as vLLM's automatic prefix caching keys its blocks), then
extended token by token against the chosen slot's ids, so a match is exact to the token.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK_TOKENS = 16


def block_hashes(token_ids: list[int]) -> list[int]:
    """Hash i covers tokens [0, 16*(i+1)): equal hashes mean equal prefixes (up to a collision, checked later)."""
    hashes, running = [], 0
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        running = hash((running, tuple(token_ids[start : start + BLOCK_TOKENS])))
        hashes.append(running)
    return hashes


@dataclass(frozen=True)
class PrefixMatch:
    slot: int
    length: int
    """Tokens of the prompt whose keys and values the slot holds at positions 0..length-1."""
    whole: bool
    """The slot is parked and holds nothing past the match: the prompt can take the slot over instead of copying
    from it."""


class PrefixCache:
    """Parked slots, the prompts of running rows, and the index from prefix hashes to both.

    A running row's slot holds its prompt's keys and values at positions 0..len-1 from its admission on, and
    nothing writes there again while it runs, so a prompt admitted later may copy that prefix from it (`hold`):
    requests over a new shared prefix that arrive across several admissions (a served burst, agents starting
    a step one after another) compute it once, as vLLM's prefix caching shares the blocks of running requests.
    Only parked slots are ever evicted or taken over."""

    def __init__(self) -> None:
        self._parked: OrderedDict[int, list[int]] = OrderedDict()
        """Parked slot -> the token ids it holds, least recently used first."""
        self._running: dict[int, list[int]] = {}
        """A running row's slot -> its prompt ids (`hold`)."""
        self._slots_by_hash: dict[int, set[int]] = {}
        self._hashes: dict[int, list[int]] = {}
        self._weights = 0
        """How many times the weights changed; each indexed slot remembers the count it was indexed at."""
        self._indexed_at: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def parked_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._parked.values())

    def park(self, slot: int, token_ids: list[int]) -> None:
        """Remember that `slot` holds the keys and values of `token_ids` (positions 0..len-1)."""
        self.release(slot)
        self._parked[slot] = list(token_ids)
        self._index(slot, block_hashes(token_ids))

    def hold(self, slot: int, prompt: list[int], hashes: list[int] | None = None) -> None:
        """`slot` now runs a row whose prompt is `prompt` (its keys and values computed or copied there):
        later prompts may copy that prefix from it until the row ends (`park` or `release`). `prompt` is kept,
        not copied (the engine's request keeps its prompt as it came). `hashes`: the prompt's `block_hashes`,
        when the caller has them."""
        self.release(slot)
        self._running[slot] = prompt
        self._index(slot, block_hashes(prompt) if hashes is None else hashes)

    def _index(self, slot: int, hashes: list[int]) -> None:
        self._indexed_at[slot] = self._weights
        self._hashes[slot] = hashes
        for value in hashes:
            self._slots_by_hash.setdefault(value, set()).add(slot)

    def release(self, slot: int) -> bool:
        """Forget `slot` (it is taken by a row, evicted, or its row ended unparked); whether it was parked."""
        parked = self._parked.pop(slot, None) is not None
        if not parked and self._running.pop(slot, None) is None:
            return False
        del self._indexed_at[slot]
        for value in self._hashes.pop(slot):
            holders = self._slots_by_hash[value]
            holders.discard(slot)
            if not holders:
                del self._slots_by_hash[value]
        return parked

    def held(self, slot: int) -> int:
        """Positions of `slot` that a match may read (0 for a slot not parked)."""
        return len(self._parked.get(slot, ()))

    def relabel(self, moved: dict[int, int]) -> None:
        """Slot `old` now lies in `moved[old]` (the batch swapped slots to pack its running rows low): a parked
        slot's tokens, age and place in the eviction order go with it, as a running row's prompt does."""
        if not any(slot in self._hashes for slot in moved):
            return
        self._parked = OrderedDict((moved.get(s, s), tokens) for s, tokens in self._parked.items())
        self._running = {moved.get(s, s): prompt for s, prompt in self._running.items()}
        self._indexed_at = {moved.get(s, s): at for s, at in self._indexed_at.items()}
        self._hashes = {moved.get(s, s): hashes for s, hashes in self._hashes.items()}
        self._slots_by_hash = {
            h: {moved.get(s, s) for s in slots} for h, slots in self._slots_by_hash.items()
        }

    def evict(self, protected: set[int]) -> int | None:
        """Release the least recently used parked slot not in `protected`; None when there is none."""
        for slot in self._parked:
            if slot not in protected:
                self.release(slot)
                return slot
        return None

    def clear(self) -> list[int]:
        """Forget every parked slot and running prompt (the weights changed, or the cache is freed); returns the
        parked slots."""
        slots = list(self._parked)
        self._parked.clear()
        self._running.clear()
        self._indexed_at.clear()
        self._slots_by_hash.clear()
        self._hashes.clear()
        return slots

    def new_weights(self, keep: int = 0) -> list[int]:
        """The weights changed: forget every slot indexed more than `keep` weight changes ago (0: all of them);
        returns the forgotten parked slots (a running row keeps its slot, only its prompt is no longer offered).
        A kept slot's keys and values were computed by older weights, as a sequence running across the change
        keeps its own (asynchronous training's partial rollouts)."""
        self._weights += 1
        stale = [slot for slot, at in self._indexed_at.items() if at < self._weights - keep]
        forgotten = []
        for slot in stale:
            if self.release(slot):  # parked: the slot is free again (a running row keeps its own)
                forgotten.append(slot)
        return forgotten

    def _chosen(self, slots: set[int]) -> int:
        """Of the slots holding a prefix, the most recently used parked one (one pass over the parked order,
        not one per slot), else the lowest running one."""
        parked = [slot for slot in slots if slot in self._parked]
        if not parked:
            return min(slots)
        if len(parked) == 1:
            return parked[0]
        return next(slot for slot in reversed(self._parked) if slot in slots)

    def longest(
        self, prompt: list[int], touch: bool = True, hashes: list[int] | None = None
    ) -> PrefixMatch | None:
        """The parked slot or running row sharing the longest prefix with `prompt`, leaving at least one prompt
        token to compute (its logits start the answer); None below one block. `touch=False` only looks: the slot
        keeps its place in the eviction order. `hashes`: the prompt's `block_hashes`, when the caller has them."""
        hashes = block_hashes(prompt) if hashes is None else hashes
        for blocks in range(len(hashes), 0, -1):
            holders = self._slots_by_hash.get(hashes[blocks - 1])
            if not holders:
                continue
            slot = next(iter(holders)) if len(holders) == 1 else self._chosen(holders)
            parked = slot in self._parked
            tokens = self._parked[slot] if parked else self._running[slot]
            length = blocks * BLOCK_TOKENS
            if tokens[:length] != prompt[:length]:  # a hash collision: never reuse what does not match
                return None
            limit = min(len(tokens), len(prompt) - 1)
            while length < limit and tokens[length] == prompt[length]:
                length += 1
            length = min(length, len(prompt) - 1)
            if length < BLOCK_TOKENS:
                return None
            if touch and parked:
                self._parked.move_to_end(slot)
            return PrefixMatch(slot, length, whole=parked and length == len(tokens))
        return None


def shared_prefixes(
    prompts: dict[int, list[int]], starts: dict[int, int], min_gain: int
) -> dict[int, tuple[int, int]]:
    """Prompts of one admission that can start from another's prefix: follower -> (leader, tokens shared).

    Nothing is parked for prompts that share a prefix but arrive together (a served benchmark's requests
    over a few long system prompts, the first turns of agents with one system prompt): each would compute the
    prefix again. Here a prompt follows the earliest prompt, itself no follower, with which it shares the most
    whole blocks (then token by token), when that saves at least `min_gain` tokens beyond the `starts` it
    already has (a parked prefix); at least one of its tokens is left to compute."""
    leaders: dict[int, int] = {}
    followers: dict[int, tuple[int, int]] = {}
    for i, prompt in prompts.items():
        hashes = block_hashes(prompt)
        found = None
        for blocks in range(len(hashes), 0, -1):
            leader = leaders.get(hashes[blocks - 1])
            if leader is not None:
                found = (leader, blocks * BLOCK_TOKENS)
                break
        if found is not None:
            leader, length = found
            other = prompts[leader]
            if other[:length] == prompt[:length]:  # a hash collision never shares what differs
                limit = min(len(other), len(prompt) - 1)
                while length < limit and other[length] == prompt[length]:
                    length += 1
                length = min(length, len(prompt) - 1)
                if length - starts.get(i, 0) >= min_gain:
                    followers[i] = (leader, length)
                    continue
        for value in hashes:
            leaders.setdefault(value, i)
    return followers

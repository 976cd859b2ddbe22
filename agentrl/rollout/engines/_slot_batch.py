"""The running batch of the embedded engine over a preallocated slot cache, decoded under CUDA graphs.

Each engine row owns a slot: a row of a (slots, kv_heads, length, D) key and value tensor per layer,
where position p of the sequence lives at index p. Admitting requests prefills their prompts once
(transformers' forward, left-padded together), copies each prompt's keys and values into as many
slots as it has completions, and returns the logits of their last prompt token. A decode step feeds
every row's pending token through `decode_step` over the first `bucket` slots (on CUDA a power of two
that covers the highest slot in use, replaying the CUDA graph captured for that bucket; elsewhere the next
multiple of 8).

Rows whose sampling needs nothing from the host (no grammar, blocked tokens or top logprobs) can
decode without a host round trip per token: the slot's token, position, sampling settings and draw
counter live on the device, and `decode_sampled` replays one graph that decodes, draws every row's next
token there and writes it back as the slot's next input, then only starts copying the results to pinned
host memory.
The engine launches step k+1 before it reads step k's tokens, so the GPU never waits for the
scheduler's Python. A row that finished at step k runs one step more; its token is discarded.

A vision-language model's rows are the same rows: its prefill also takes the prompts' pixels (`vision.py`'s
`ImagePrefill`: vision tower, multimodal positions), and each slot keeps one more integer, its rotary offset,
which the decode and extend steps add to the cache index.

The cache length grows on demand (powers of two, up to max_model_len). The hybrid engine's sleep returns its
memory to training (`release_cache`): under CUDA graphs the cache lives at reserved addresses whose pages are
unmapped and mapped again (`_stable_memory.py`), so the graphs survive the sleep; elsewhere it is freed. Graphs
point at the cache and the weights: they are dropped whenever either may have moved (growth, `clear`, weight
loads to new addresses).
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.models.attention_kernels import cudnn_attention_for_capture
from agentrl.models.compile_cache import use_compile_cache
from agentrl.rollout.engines._compiled_steps import (
    compiled_decode_step,
    compiled_extend_step,
    compiled_flash_extend_step,
)
from agentrl.rollout.engines._flash_extend import (
    WIDTH,
    flash_extend_step,
    flash_sequences,
    packed_rows,
)
from agentrl.rollout.engines._fused_projections import FusedProjections, LayerFused
from agentrl.rollout.engines._graph_launch import GraphLauncher
from agentrl.rollout.engines._prefix_cache import (
    BLOCK_TOKENS,
    PrefixCache,
    PrefixMatch,
    block_hashes,
    shared_prefixes,
)
from agentrl.rollout.engines._sampling import as_int64, policy_logprob, sample_on_device
from agentrl.rollout.engines._slot_decode import (
    KVShape,
    decode_step,
    extend_step,
    prefill_slots,
    text_config,
    text_model,
)
from agentrl.rollout.engines._stable_memory import StableMemory, stable_memory
from agentrl.rollout.engines._staging import PinnedStaging
from agentrl.rollout.engines.flash_attention import FlashRows, flash_cache_attention_supported
from agentrl.rollout.engines.shared_prefix_attention import (
    SharedPrefix,
    placeholder_plans,
    plan_shared_prefix,
)
from agentrl.rollout.engines.vision import (
    ImageInputs,
    ImagePrefill,
    PromptImages,
    is_vision_language,
    placeholder_token_ids,
)

logger = logging.getLogger(__name__)
MIN_LENGTH = 256
MIN_BUCKET = 8
CACHE_SHARE_OF_FREE_MEMORY = 0.9
SPAN_STEP = 64
"""Granularity of the cache span an eager decode step reads (`SlotBatch._span`)."""
SHARED_PREFIX_MIN_GAIN = 32
"""Fewest prompt tokens a shared prefix within one admission must save to be worth a second prefill forward."""
EXTEND_MAX_TOKENS = WIDTH
"""With CUDA graphs but no `flash_extend_step` (prompts with images, GPUs before Ampere, float32), prompts with at
most this many tokens left to compute (a next turn over a cached history) go through `extend_step`'s graphs;
longer ones (and all of them without graphs) through the packed `prefill_slots`. `flash_extend_step` takes every
text prompt, whatever its length."""
MIN_EXTEND_WIDTH = 16
PREFILL_MASK_ELEMENTS = 1 << 26
"""Most attention-mask elements (rows x query rows x keys) one prefill forward builds: bounds its memory."""
PREFILL_PATHS = ("extend", "packed")
"""The two prefill paths, counted apart: `extend` (`flash_extend_step`, every text prompt where FlashAttention
reads the cache, under CUDA graphs or eagerly; else `extend_step`, short runs under CUDA graphs) and `packed`
(`prefill_slots`, eager)."""


@dataclass
class _AdmissionPlan:
    """How one admission's prompts reach the cache."""

    prefill: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Prompt index -> (its slot, the first position to compute)."""
    same_as: dict[int, int] = field(default_factory=dict)
    """Prompt index -> an earlier identical prompt of the admission whose keys and values it copies."""
    copies_before: list[tuple[int, int, int]] = field(default_factory=list)
    """(parked slot, new slot, tokens) prefixes copied before the prefill."""
    sources: set[int] = field(default_factory=set)
    """Parked slots copied from: evicted for a new row only when no other parked slot is left."""


@dataclass
class _PrefillMark:
    """Where a prefill forward began: the host's clock and, on CUDA, a timing event; `end`, an event recorded
    right after the launch of a forward that is one graph (else `_prefill_done` records it)."""

    host_start: float
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None


def weight_layout(model: torch.nn.Module) -> tuple:
    """Where each parameter and buffer lives (address, dtype, shape, strides), in a fixed order: equal
    before and after an update exactly when the update wrote every tensor in place."""
    return tuple(
        (t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in (*model.parameters(), *model.buffers())
    )


def _padded(values: Iterable[int], width: int, fill: int) -> list[int]:
    """`values` as a list of `width` items, `fill` after them."""
    values = list(values)
    return values + [fill] * (width - len(values))


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _token_bucket(tokens: int) -> int:
    """Tokens a `flash_extend_step` graph computes for `tokens` real ones: at least `WIDTH`, else rounded up to
    a sixteenth of their power of two (at most 1/16 padding; powers of two padded 650 tokens to 1,024, eighths
    padded 12 next turns of 48 tokens, 576, to 640, where the MLP's matrix multiply takes 192 rows a tile)."""
    if tokens <= WIDTH:
        return WIDTH
    step = max(WIDTH, _next_power_of_two(tokens) // 16)
    return -(-tokens // step) * step


@dataclass
class DeviceDraw:
    """Tokens and logprobs drawn on the device for some slots, on their way to the host."""

    slots: list[int]
    results: torch.Tensor
    """(steps, 2, n) float64: per decode step, token ids (exact below 2^53) and logprobs, indexed by slot;
    pinned memory on CUDA."""
    ready: torch.cuda.Event | None

    def read(self) -> list[tuple[list[int], list[float]]]:
        """Wait for the copy, then per step each slot's token id and logprob, in `slots` order."""
        if self.ready is not None:
            self.ready.synchronize()
        return [
            ([int(ids[s]) for s in self.slots], [logprobs[s] for s in self.slots])
            for ids, logprobs in self.results.tolist()
        ]


@dataclass(frozen=True)
class SlotSampling:
    """The sampling settings of the rows a `load_rows` call writes to the device, one entry per row."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    seeds: list[int]
    drawn: list[int]
    """Tokens each row has drawn so far: the position of its next draw within the completion."""
    limits: list[int]
    """Most tokens each row may draw (its max_tokens, or fewer where max_model_len comes first): a row at its
    limit stops advancing, so decode steps launched past its end never write beyond its reserved positions."""


class SlotBatch:
    """Rows (in engine order) mapped to cache slots; admit, decode, keep, clear."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_slots: int,
        max_model_len: int,
        cuda_graphs: bool,
        compile_decode: bool = False,
        prefix_caching: bool = True,
        prefill_chunk_tokens: int = 8192,
        fuse_projections: bool = True,
    ) -> None:
        """`prefix_caching`: reuse the keys and values of prompt prefixes already computed (`_prefix_cache.py`).
        `prefill_chunk_tokens`: the most prompt tokens one prefill forward computes. `compile_decode`: run the
        decode and extend steps through torch.compile under CUDA graphs (Inductor fuses the ~40 small kernels
        per layer, norms, rotary, residuals, that keep a graph replay launch-bound), and the decode step on the
        CPU (each of those kernels an eager call there; the packed prefill stays eager). `fuse_projections`: multiply
        by concatenated copies of each layer's q/k/v and gate/up weights (`_fused_projections.py`) where the
        layers allow it."""
        self.model = model
        self.shape = KVShape.of(model)
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        layers = text_model(model).layers
        self.fused = FusedProjections.of(layers, stable=self.cuda_graphs) if fuse_projections else None
        """Concatenated projection weights the steps multiply by, or None (off, or layers they cannot serve)."""
        self._decode_step = decode_step
        self._extend_step = extend_step
        if compile_decode and (self.cuda_graphs or self.device.type == "cpu"):
            use_compile_cache(model.config, next(model.parameters()).dtype, self.device)
            self._decode_step = compiled_decode_step()
            if self.cuda_graphs:  # the CPU prefills through `prefill_slots` only
                self._extend_step = compiled_extend_step()
        self._flash_step: Callable[..., torch.Tensor] | None = None
        """`flash_extend_step` (compiled with the others under CUDA graphs) where FlashAttention reads the cache in
        place: it prefills every text prompt (`_flash_extend`), in place of `_extend_step` and `prefill_slots`."""
        if flash_cache_attention_supported(self.device, self.shape.dtype):
            compiled = compile_decode and self.cuda_graphs
            self._flash_step = compiled_flash_extend_step() if compiled else flash_extend_step
        self._min_extend_width = (
            EXTEND_MAX_TOKENS if self._extend_step is not extend_step else MIN_EXTEND_WIDTH
        )
        """Narrowest extend forward: compiled, one width (each other width would compile again)."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0
        self._memory: StableMemory | None = None
        """What `keys` and `values` lie in under CUDA graphs, when the driver offers stable addresses."""
        self._free = list(range(max_slots))
        self._row_slots: list[int] = []
        self._row_positions: list[int] = []
        self._plans_compiled = False
        """Whether `compile_now` traced the compiled decode step on shared-prefix plans: until then (or with
        fewer slots than its placeholders take) that step reads every row's own copy, compiling nothing more."""
        self._row_prefixes: list[tuple[int, ...]] = []
        """Each row's prompt as `block_hashes` mixed with the weights it was admitted under (empty when unknown):
        which rows share a prefix. Rows admitted under other weights hold other keys for the same tokens."""
        self._weight_changes = 0
        self._shares_prefixes = self.device.type == "cpu" and self.shape.dtype == torch.float32
        """Decode steps read a prefix rows share once (`shared_prefix_attention`): the float32 CPU step, which
        attends with matrix products (`decode_attention`) and is bound by reading the cache."""
        self._shared: tuple[tuple[int, ...], SharedPrefix | None] | None = None
        """The last decode step's bucket and slots and how its rows shared a prefix; None once rows come or go
        (a new row may take a finished row's slot)."""
        self._token_ids = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        # Per-slot state of `decode_sampled` (written by `load_rows`); positions of free slots stay 0.
        self._active = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._temperature = torch.zeros(max_slots, dtype=torch.float32, device=self.device)
        self._top_p = torch.ones(max_slots, dtype=torch.float32, device=self.device)
        self._top_k = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._seeds = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._drawn = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._limits = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self.images = ImagePrefill(model) if is_vision_language(model) else None
        self._rope_offsets = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        """Rotary position minus cache index of each slot's next tokens (nonzero after an image)."""
        self._image_keys: dict[int, list[int]] = {}
        """Slot -> the `prefix_key` of its prompt, for a row whose prompt has images (what it parks under)."""
        never = placeholder_token_ids(model)
        self._never = torch.tensor(never, device=self.device) if never else None
        """Token ids no draw on the device may choose (image pads: they stand for pixels)."""
        self._graphs: dict[
            int | tuple[int, tuple[bool, bool], int], tuple[torch.cuda.CUDAGraph, torch.Tensor]
        ] = {}
        self._graph_pool = None
        self._graph_weights: tuple | None = None
        """`weight_layout` of the model when the graphs in `_graphs` were captured."""
        self._largest_logged = 0
        self.prefix_caching = prefix_caching
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefixes = PrefixCache()
        self._extend_inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._staging = PinnedStaging(self.device)
        self._groups = text_config(model).num_attention_heads // self.shape.kv_heads
        self.counters = dict.fromkeys(
            (
                "prompt_tokens",
                "prefix_hit_tokens",
                "prefill_tokens",
                "prefill_forwards",
                "prefill_s",
                "compacted_rows",
                "prefill_parts",
                "shared_prefix_prefills",
                "shared_prefix_decodes",
            )
            + tuple(
                f"{path}_{what}" for path in PREFILL_PATHS for what in ("forwards", "tokens", "s", "host_s")
            ),
            0,
        )
        """Cumulative: prompt tokens admitted, of them found in the cache, tokens computed by prefill forwards,
        those forwards and their seconds (`EmbeddedEngine.stats`; on CUDA, device time read off events once
        they complete: `settle_timings`); the same per path (`PREFILL_PATHS`), with the host's seconds issuing
        them (building inputs and launching; a forward whose host seconds near its device seconds is host-bound)."""
        self._launcher = GraphLauncher(self.device) if self.device.type == "cuda" else None
        """Launches the graphs and records the prefill's timing events without letting go of the GIL."""
        self._prefill_events: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
        self._events_lock = threading.Lock()
        self.setup_s = {"cache_alloc_s": 0.0, "graph_capture_s": 0.0}
        """Cumulative seconds spent (re)allocating the cache and capturing graphs: both recur after each
        sleep, inside the prefill and decode time the engine reports."""

    @property
    def size(self) -> int:
        return len(self._row_slots)

    @property
    def slots(self) -> int:
        """Cache positions per slot (what `stats()` reports as kv_slots)."""
        return self.length

    # ----- rows ------------------------------------------------------------------------------------
    def admit(
        self,
        prompts: list[list[int]],
        copies: list[int],
        reserve: int,
        images: list[ImageInputs | None] | None = None,
        computed_in_parts: list[int] | None = None,
        hashes: list[list[int] | None] | None = None,
    ) -> torch.Tensor:
        """Prefill `prompts`, give prompt i `copies[i]` slots; rows are appended. Returns their first logits.

        `reserve`: the longest sequence (prompt + new tokens) any admitted row may reach. With prefix caching a
        prompt starts from the parked slot holding its longest prefix (taking the slot over when the prompt
        extends all it holds: an agent's next turn), and identical prompts of one admission (GRPO siblings
        sent as separate requests) are computed once; only the rest is prefilled (`prefill_slots`, packed).
        Text prompts of one admission that share a prefix not parked anywhere (`shared_prefixes`) compute it
        once: the first of them in a first forward, the others from a copy of it in a second.
        `images`: each prompt's pixels (None for a text prompt); prompts are compared by `prefix_key`, which
        tells images apart. `computed_in_parts`: tokens of each prompt that `prefill_part` computed in earlier
        engine steps; found parked now, they are not counted as prefix cache hits. `hashes`: each text prompt's
        `block_hashes` when the caller has them (the engine computes them as a request arrives, off its thread).
        """
        self._ensure_length(reserve + 1)  # position length-1 stays the idle slots' sink
        images = images or [None] * len(prompts)
        keys = (
            [self.images.key(p, x) for p, x in zip(prompts, images, strict=True)] if self.images else prompts
        )
        parts = computed_in_parts or [0] * len(prompts)
        plan = _AdmissionPlan()
        first_of: dict[tuple[int, ...], int] = {}
        matches: dict[int, PrefixMatch | None] = {}
        for i, prompt in enumerate(prompts):
            self.counters["prompt_tokens"] += len(prompt)
            key = tuple(keys[i])
            if self.prefix_caching and key in first_of:
                plan.same_as[i] = first_of[key]
                self.counters["prefix_hit_tokens"] += len(prompt)
                continue
            first_of[key] = i
            known = hashes[i] if hashes is not None and images[i] is None and not self.images else None
            matches[i] = self.prefixes.longest(keys[i], hashes=known) if self.prefix_caching else None
        # Every match is found before any slot is claimed, and all of them are spared while another slot will
        # do: claiming one at a time evicted parked prefixes that later prompts of the same admission were to
        # copy from, and those waited for a second forward (a serve wave of 32: 1-2 rows a wave).
        plan.sources = {match.slot for match in matches.values() if match is not None}
        for i, match in matches.items():
            if match is not None and match.whole and self.prefixes.held(match.slot) != match.length:
                # Taken by an earlier prompt of this admission: its positions 0..length-1 still hold the
                # prefix until the prefill (every copy runs before it), so copy instead of taking it over.
                match = PrefixMatch(match.slot, match.length, whole=False)
            slot, copy = self._claim_slot(match, plan.sources)
            if copy is not None:
                plan.copies_before.append(copy)
            start = match.length if match is not None else 0
            self.counters["prefix_hit_tokens"] += start - min(start, parts[i])
            plan.prefill[i] = (slot, start)
        self._copy_prefixes(plan.copies_before)
        # Only prompts with more than the minimum gain left to compute can follow or lead: an agent's next turn
        # (its history parked) is neither, and its blocks are not hashed a second time here.
        text = {
            i: prompts[i]
            for i, (_, start) in plan.prefill.items()
            if images[i] is None and len(prompts[i]) - start > SHARED_PREFIX_MIN_GAIN
        }
        followers = (
            shared_prefixes(text, {i: plan.prefill[i][1] for i in text}, SHARED_PREFIX_MIN_GAIN)
            if self.prefix_caching
            else {}
        )
        first = {i: at for i, at in plan.prefill.items() if i not in followers}
        shareable = hashes if hashes is not None and self._shares_prefixes and not self.images else None
        last_logits, offsets = self._prefill_planned(first, prompts, images, shareable)
        if followers:  # their leaders' prefixes are computed now: copy them, prefill the rest
            self._copy_prefixes(
                [(plan.prefill[j][0], plan.prefill[i][0], n) for i, (j, n) in followers.items()]
            )
            for i, (_, length) in followers.items():
                self.counters["prefix_hit_tokens"] += length - plan.prefill[i][1]
                plan.prefill[i] = (plan.prefill[i][0], length)
            more, more_offsets = self._prefill_planned(
                {i: plan.prefill[i] for i in followers}, prompts, images, shareable
            )
            last_logits.update(more)
            offsets.update(more_offsets)
        row_slots: list[int] = []
        row_logits: list[torch.Tensor] = []
        copies_after: list[tuple[int, int, int]] = []
        for i, prompt in enumerate(prompts):
            owner = plan.same_as.get(i, i)
            source = plan.prefill[owner][0]
            for copy in range(copies[i]):
                slot = source if copy == 0 and owner == i else self._take_slot(plan.sources)
                if slot != source:
                    copies_after.append((source, slot, len(prompt)))
                row_slots.append(slot)
                row_logits.append(last_logits[owner])
        self._copy_prefixes(copies_after)
        owners = [plan.same_as.get(i, i) for i in range(len(prompts)) for _ in range(copies[i])]
        # later admissions may copy a text prompt's prefix from its rows while they run
        if self.prefix_caching:
            held: dict[int, list[int]] = {}
            for slot, i in zip(row_slots, owners, strict=True):
                if images[i] is None:
                    if i not in held:
                        given = hashes[i] if hashes is not None and not self.images else None
                        held[i] = block_hashes(keys[i]) if given is None else given
                    self.prefixes.hold(slot, keys[i], held[i])
        self._row_slots += row_slots
        self._row_positions += [len(prompts[i]) for i in range(len(prompts)) for _ in range(copies[i])]
        known = shareable or [None] * len(prompts)
        prefixes = [
            tuple(hash((self._weight_changes, h)) for h in known[i] or ()) for i in range(len(prompts))
        ]
        self._row_prefixes += [prefixes[i] for i in range(len(prompts)) for _ in range(copies[i])]
        self._shared = None
        self._set_slots(row_slots, self._active, [1] * len(row_slots))
        if self.images is not None:
            self._set_slots(row_slots, self._rope_offsets, [offsets[i] for i in owners])
            for slot, i in zip(row_slots, owners, strict=True):
                if images[i] is not None:
                    self._image_keys[slot] = keys[i]
        return torch.stack(row_logits)

    def _prefill_planned(
        self,
        prefill: dict[int, tuple[int, int]],
        prompts: list[list[int]],
        images: list[ImageInputs | None],
        hashes: list[list[int] | None] | None = None,
    ) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        """Compute each planned prompt from its start position: with CUDA graphs, short runs through `_extend`
        (one graph replay), the rest (and any that computes image pads) through `_prefill_chunks`; without
        graphs every run through `_prefill_chunks`, whose packed forward pads nothing (`_extend` pads rows,
        width and span to powers of two: a third more time for 32 agent turns on the CPU). Their last logits
        and rotary offsets. `hashes`: the prompts' `block_hashes` where the packed forward may read a prefix
        its rows share once (`_shared_cached_prefix`), else None."""
        computed = {i: prompts[i][start:] for i, (_, start) in prefill.items()}
        pixels = {i: images[i] for i in prefill if images[i] is not None}
        vision: dict[int, PromptImages] = {}
        if pixels:
            starts = {i: prefill[i][1] for i in pixels}
            vision = self.images.prepare({i: prompts[i] for i in pixels}, pixels, starts)
        offsets = {i: vision[i].offset if i in vision else 0 for i in prefill}
        if self._flash_step is not None and not vision:  # every text prompt, whatever its length
            return self._flash_extend(prefill, computed), offsets
        short = {
            i: at
            for i, at in prefill.items()
            if self.cuda_graphs
            and len(computed[i]) <= EXTEND_MAX_TOKENS
            and (i not in vision or vision[i].pads_before[-1] == vision[i].pads_before[at[1]])
        }  # pads to compute go through `prefill_slots`, which reads image features
        long = {i: at for i, at in prefill.items() if i not in short}
        extended = self._extend(short, computed, offsets)
        logits = {**self._prefill_chunks(long, computed, vision, hashes), **extended}
        return logits, offsets

    def cached_tokens(self, prompt: list[int], hashes: list[int] | None = None) -> int:
        """Tokens of `prompt` a parked slot holds (what admitting it would not compute); the eviction order is
        left as it is. `hashes` as in `admit`."""
        match = self.prefixes.longest(prompt, touch=False, hashes=hashes) if self.prefix_caching else None
        return match.length if match is not None else 0

    def prefill_part(self, tokens: list[int], reserve: int) -> int:
        """Compute the keys and values of `tokens`, the first part of a prompt too long for one engine step, and
        park the slot holding them: the prompt's next part (or its admission) finds them as a cached prefix and
        computes only what follows. `reserve` as in `admit`, for the whole prompt. Returns the tokens computed.
        Needs prefix caching (a part waits in the prefix cache between steps)."""
        self._ensure_length(reserve + 1)
        match = self.prefixes.longest(tokens)
        slot, copy = self._claim_slot(match, {match.slot} if match is not None else set())
        self._copy_prefixes([copy] if copy is not None else [])
        start = match.length if match is not None else 0
        self._prefill_planned({0: (slot, start)}, [tokens], [None])
        self.prefixes.park(slot, tokens)
        self.counters["prefill_parts"] += 1
        return len(tokens) - start

    def _claim_slot(
        self, match: PrefixMatch | None, preserved: set[int]
    ) -> tuple[int, tuple[int, int, int] | None]:
        """The slot a prompt's keys and values go to: the parked slot of a match it extends whole is taken over;
        else a new slot (`_take_slot`), with the copy (source, slot, tokens) of the matched prefix to make into it
        (None without a match)."""
        if match is not None and match.whole:
            self.prefixes.release(match.slot)
            return match.slot, None
        slot = self._take_slot(preserved)
        return slot, (match.slot, slot, match.length) if match is not None else None

    def _take_slot(self, preserved: set[int]) -> int:
        """A slot for a new row: a free one, else the least recently used parked one, sparing those this
        admission copies from while another will do. Taking a slot that is copied from is still safe: every
        copy out of a parked slot happens before the prefill writes to any slot."""
        if self._free:
            return heapq.heappop(self._free)
        slot = self.prefixes.evict(preserved)
        if slot is None:
            slot = self.prefixes.evict(set())
        if slot is None:
            raise RuntimeError(f"no free cache slot: all {self.max_slots} hold running sequences")
        return slot

    def _copy_prefixes(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy positions 0..n-1 of each source slot to its target slot, every pair in one indexed copy per
        layer (a target gets up to the longest n; what lies past its own n is overwritten or masked)."""
        if not copies:
            return
        sources = self._to_device([c[0] for c in copies])
        targets = self._to_device([c[1] for c in copies])
        longest = max(c[2] for c in copies)
        with torch.inference_mode():
            for cache in (*self.keys, *self.values):
                cache[targets, :, :longest] = cache[sources, :, :longest]

    def _extend(
        self, prefill: dict[int, tuple[int, int]], computed: dict[int, list[int]], offsets: dict[int, int]
    ) -> dict[int, torch.Tensor]:
        """Prefill short token runs (a next turn whose history is cached) with `extend_step`, at most `max_slots`
        rows a call, under a CUDA graph per (rows, width) bucket on CUDA; each prompt's last logits."""
        logits: dict[int, torch.Tensor] = {}
        items = list(prefill.items())
        for first in range(0, len(items), self.max_slots):
            group = items[first : first + self.max_slots]
            started = self._prefill_started()
            rows = self._bucket(len(group))
            width = min(
                EXTEND_MAX_TOKENS,
                max(self._min_extend_width, _next_power_of_two(max(len(computed[i]) for i, _ in group))),
            )
            # Built as Python lists, then one tensor each (not a few torch calls per row).
            idle = [[0, 0, 0]] * (rows - len(group))
            tokens = torch.tensor(
                [_padded(computed[i], width, 0) for i, _ in group] + [[0] * width] * len(idle)
            )
            positions = torch.tensor(
                [_padded(range(at, at + len(computed[i])), width, self.sink) for i, (_, at) in group]
                + [[self.sink] * width] * len(idle)
            )
            slots, last, rope_offsets = (
                torch.tensor([[slot, len(computed[i]) - 1, offsets[i]] for i, (slot, _) in group] + idle)
                .t()
                .contiguous()
            )
            reach = max(start + len(computed[i]) for i, (_, start) in group)
            span = min(self.length, max(MIN_LENGTH, _next_power_of_two(reach)))
            out = self._extend_call(tokens, positions, slots, last, span, rope_offsets)
            for row, (i, _) in enumerate(group):
                logits[i] = out[row]
            self._prefill_done(started, sum(len(computed[i]) for i, _ in group), "extend")
        return logits

    def _extend_call(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        last: torch.Tensor,
        span: int,
        rope_offsets: torch.Tensor,
    ) -> torch.Tensor:
        """`extend_step` on these host tensors over cache positions 0..span-1 (a power of two, so few graphs):
        replayed from its graph on CUDA (captured on first use)."""
        inputs = (slots, tokens, positions, last)
        if not self.cuda_graphs:
            moved = (t.to(self.device) for t in inputs)
            offsets = rope_offsets.to(self.device) if self.images else None
            return self._extend_step(
                self.model, self.keys, self.values, *moved, span, offsets, fused=self._fused_layers()
            ).clone()
        key = ("extend", *tokens.shape, span)
        buffers = self._extend_inputs.get(key[:3])
        if buffers is None:
            buffers = tuple(torch.zeros_like(t, device=self.device) for t in (*inputs, rope_offsets))
            self._extend_inputs[key[:3]] = buffers
        for target, source in zip(buffers, (*inputs, rope_offsets), strict=True):
            target.copy_(self._to_device(source))
        if key not in self._graphs:

            def step() -> torch.Tensor:
                offsets = buffers[4] if self.images else None
                return self._extend_step(
                    self.model,
                    self.keys,
                    self.values,
                    *buffers[:4],
                    span,
                    offsets,
                    fused=self._fused_layers(),
                )

            self._graphs[key] = self._capture(lambda: self._compiled_or_plain("extend", step), step)
        graph, output = self._graphs[key]
        self._launcher.launch(graph)
        return output.clone()

    def _flash_extend(
        self, prefill: dict[int, tuple[int, int]], computed: dict[int, list[int]]
    ) -> dict[int, torch.Tensor]:
        """Prefill text prompts through `flash_extend_step`: their tokens packed, at most `max_slots` rows and
        `prefill_chunk_tokens` tokens a forward (a prompt that does not fit in what is left of one continues in
        the next, over what the first wrote), padded to `_token_bucket`, one CUDA graph per (tokens, rows)
        bucket; each prompt's last logits."""
        logits: dict[int, torch.Tensor] = {}
        cap = max(WIDTH, self.prefill_chunk_tokens)
        pending = [(i, slot, start, computed[i]) for i, (slot, start) in prefill.items()]
        while pending:
            calls: list[tuple[int, int, int, list[int]]] = []
            room = cap
            while pending and room > 0 and len(calls) < self.max_slots:
                i, slot, start, ids = pending.pop(0)
                calls.append((i, slot, start, ids[:room]))
                if len(ids) > room:  # the rest after this forward, from where its part ends
                    pending.insert(0, (i, slot, start + room, ids[room:]))
                room -= len(calls[-1][3])
            real = cap - room
            tokens, rows = _token_bucket(real), self._bucket(len(calls))
            runs = [(slot, start, ids) for _, slot, start, ids in calls]
            inputs, sequences = packed_rows(runs, tokens, rows, self.shape.kv_heads, self.length, self.sink)
            out, started = self._flash_call(inputs, sequences, tokens, rows)
            for row, (i, _, start, ids) in enumerate(calls):
                if start + len(ids) == prefill[i][1] + len(computed[i]):  # the prompt's last token
                    logits[i] = out[row]
            self._prefill_done(started, real, "extend")
        return logits

    def _flash_call(
        self, inputs: torch.Tensor, sequences: torch.Tensor, tokens: int, rows: int
    ) -> tuple[torch.Tensor, _PrefillMark]:
        """`flash_extend_step` on `packed_rows`' host tensors, replayed from its (tokens, rows) graph (captured on
        first use, into buffers kept per shape; run as it is without graphs); its logits and
        `_prefill_started`'s mark, made just before the forward and closed right after its launch: its device
        time is timed, not the host's work before it (a capture, the inputs' copies), which the extend path's
        host seconds count, nor a wait of the host's after it."""
        key = ("flash", tokens, rows)
        buffers = self._extend_inputs.get(key) if self.cuda_graphs else None
        if buffers is None:
            with torch.inference_mode(False):  # as `_extend_call`'s: the compiled step guards on it
                flat = torch.zeros(inputs.shape, dtype=torch.long, device=self.device)
                sequences_at = flash_sequences(tokens, rows)
                rows_at = FlashRows.empty(sequences_at, WIDTH, self.length, self.device)
            buffers = (flat, rows_at)
            if self.cuda_graphs:
                self._extend_inputs[key] = buffers
        flat, rows_at = buffers
        flat.copy_(self._to_device(inputs))
        rows_at.fill_(self._to_device(sequences, torch.int32))
        ids, positions, slots, last = flat.split([tokens, tokens, tokens, rows])

        def step() -> torch.Tensor:
            shaped = (t.view(-1, WIDTH) for t in (slots, ids, positions))
            return self._flash_step(
                self.model, self.keys, self.values, *shaped, last, rows_at, fused=self._fused_layers()
            )

        if not self.cuda_graphs:
            started = self._prefill_started()
            return step(), started
        if key not in self._graphs:
            self._graphs[key] = self._capture(lambda: self._compiled_or_plain("flash", step), step)
        graph, output = self._graphs[key]
        started = self._prefill_started()
        self._launcher.launch(graph)
        started.end = self._launcher.mark()
        return output.clone(), started

    def _prefill_chunks(
        self,
        prefill: dict[int, tuple[int, int]],
        computed: dict[int, list[int]],
        vision: dict[int, PromptImages] | None = None,
        hashes: list[list[int] | None] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Run the prompts' uncached tokens through `prefill_slots` in forwards of bounded size (a long prompt
        spans several, its later chunks attending to the earlier ones in its slot); each prompt's last logits.
        `hashes` as in `_prefill_planned`."""
        pending = [(i, slot, start, computed[i]) for i, (slot, start) in prefill.items()]
        logits: dict[int, torch.Tensor] = {}
        while pending:
            batch: list[tuple[int, int, int, list[int]]] = []
            tokens = span = width = 0
            for i, slot, start, ids in pending:
                take = min(len(ids), max(1, self.prefill_chunk_tokens - tokens))
                while (
                    not batch and take > 64 and self._groups * take * (start + take) > PREFILL_MASK_ELEMENTS
                ):
                    take //= 2  # one long prompt alone: smaller chunks, each attending to the ones before
                wider, longer = max(width, take), max(span, start + take)
                if batch and (
                    tokens + take > self.prefill_chunk_tokens
                    or (len(batch) + 1) * self._groups * wider * longer > PREFILL_MASK_ELEMENTS
                ):
                    break
                batch.append((i, slot, start, ids[:take]))
                tokens, span, width = tokens + take, longer, wider
            started = self._prefill_started()
            packed = self.images.pack([(b[3], b[2], vision.get(b[0])) for b in batch]) if vision else None
            shared = self._shared_cached_prefix(batch, hashes)
            self.counters["shared_prefix_prefills"] += shared is not None
            out = prefill_slots(
                self.model, self.keys, self.values, [b[1] for b in batch], [b[2] for b in batch],
                [b[3] for b in batch], packed, self._to_device, self._fused_layers(), shared,
            )  # fmt: skip
            left_over = []
            for row, (i, slot, start, chunk) in enumerate(batch):
                rest = computed[i][start + len(chunk) - prefill[i][1] :]
                if rest:
                    left_over.append((i, slot, start + len(chunk), rest))
                else:
                    logits[i] = out[row]
            pending = left_over + pending[len(batch) :]
            self._prefill_done(started, tokens, "packed")
        return logits

    def _shared_cached_prefix(
        self, batch: list[tuple[int, int, int, list[int]]], hashes: list[list[int] | None] | None
    ) -> SharedPrefix | None:
        """How the rows of a packed forward (prompt, slot, start, tokens) share a prefix that each holds already
        (`plan_shared_prefix` over the blocks before each row's start), or None: each group's prefix read once
        without a mask and no row's copy of it gathered, the attention of 32 rows of 64 new tokens over 4 cached
        prefixes of 512 took 1.2x less time on 2 cores (`benchmarks/shared_prefix_decode.py`). Every row's
        prompt needs its hashes."""
        if hashes is None or len(batch) < 2 or any(hashes[i] is None for i, *_ in batch):
            return None
        cached = [tuple(hashes[i][: start // BLOCK_TOKENS]) for i, _, start, _ in batch]
        return plan_shared_prefix(list(range(len(batch))), cached, len(batch), BLOCK_TOKENS, self.device)

    def _prefill_started(self) -> _PrefillMark:
        """Mark the start of a prefill forward: the host's clock, and on CUDA an event on the device (waiting
        for the device to time it would stall the host behind the decode step launched ahead)."""
        if self._launcher is None:
            return _PrefillMark(time.perf_counter())
        start = self._launcher.mark()
        return _PrefillMark(time.perf_counter(), start)

    def _prefill_done(self, started: _PrefillMark, tokens: int, path: str) -> None:
        host_s = time.perf_counter() - started.host_start
        for prefix in ("prefill", path):
            self.counters[f"{prefix}_tokens"] += tokens
            self.counters[f"{prefix}_forwards"] += 1
        self.counters[f"{path}_host_s"] += host_s
        if started.start is None:
            self.counters["prefill_s"] += host_s
            self.counters[f"{path}_s"] += host_s
            return
        end = started.end or self._launcher.mark()
        with self._events_lock:
            self._prefill_events.append((started.start, end, path))
        self.settle_timings(wait=False)

    def settle_timings(self, wait: bool = True) -> None:
        """Add the device time of completed prefill forwards to `counters["prefill_s"]`; with `wait`, first wait
        for the last one recorded (what a stats reader wants)."""
        with self._events_lock:
            if wait and self._prefill_events:
                self._prefill_events[-1][1].synchronize()
            done = 0
            for start, end, path in self._prefill_events:
                if not end.query():
                    break
                seconds = start.elapsed_time(end) / 1000
                self._launcher.release(start, end)
                self.counters["prefill_s"] += seconds
                self.counters[f"{path}_s"] += seconds
                done += 1
            del self._prefill_events[:done]

    def keep(self, rows: list[int], finished: dict[int, list[int]] | None = None) -> None:
        """Keep only `rows` (in that order). A dropped row listed in `finished` (row -> the token ids its slot
        holds) parks its slot in the prefix cache; the other slots are freed."""
        kept = set(rows)
        dropped = [(i, slot) for i, slot in enumerate(self._row_slots) if i not in kept]
        for i, slot in dropped:
            tokens = (finished or {}).get(i)
            key = self._image_keys.pop(slot, None)
            if tokens and key is not None:  # its pads park under the names of their images
                tokens = key + tokens[len(key) :]
            if self.prefix_caching and tokens:
                self.prefixes.park(slot, tokens[: self.length - 1])
            else:
                self.prefixes.release(slot)
                heapq.heappush(self._free, slot)
        if dropped:  # an idle slot decodes at the sink position, which no sequence reaches
            idle = [slot for _, slot in dropped]
            self._set_slots(idle, self._active, [0] * len(idle))
            self._set_slots(idle, self._positions, [self.sink] * len(idle))
        self._row_slots = [self._row_slots[i] for i in rows]
        self._row_positions = [self._row_positions[i] for i in rows]
        self._row_prefixes = [self._row_prefixes[i] for i in rows]
        self._shared = None

    def forget_prefixes(self, keep: int = 0) -> None:
        """The weights changed: no prefix parked more than `keep` weight changes ago may be read again (and no
        running row's prefix by a row admitted from now on)."""
        self._weight_changes += 1
        for slot in self.prefixes.new_weights(keep):
            heapq.heappush(self._free, slot)

    @property
    def _extend_compiled(self) -> bool:
        """Whether the extend step runs through torch.compile (under CUDA graphs; the CPU prefills packed)."""
        return self._extend_step is not extend_step

    @property
    def compiled(self) -> bool:
        """Whether the decode step runs through torch.compile (a failed compile falls back to the plain step)."""
        return self._decode_step is not decode_step

    @property
    def held_tokens(self) -> int:
        """Cache positions holding a running or parked sequence's keys and values."""
        return sum(self._row_positions) + self.prefixes.parked_tokens

    @property
    def cache_bytes(self) -> int:
        """Device memory the cache holds now: 0 while asleep. A cache at stable addresses lies outside
        PyTorch's allocator, so `torch.cuda.max_memory_allocated` leaves it out."""
        if self._memory is not None and not self._memory.mapped:
            return 0
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def sink(self) -> int:
        """Where idle slots write during a decode step: the last cache position, beyond every sequence."""
        return max(self.length - 1, 0)

    def clear(self) -> None:
        """Drop every row, the cache and the graphs (their memory goes back to the allocator)."""
        self._drop_rows()
        self.keys, self.values, self.length = [], [], 0
        self.drop_graphs()
        memory, self._memory = self._memory, None
        if memory is not None:
            try:
                memory.free()
            except RuntimeError:  # after a failed step on a broken CUDA context: the process ends it
                logger.warning(
                    "embedded engine: the KV cache's reservation could not be freed", exc_info=True
                )

    def release_cache(self) -> None:
        """Drop every row and give the cache's memory back (the hybrid engine's sleep), and the fused weights'
        (`weights_changed` at the wake brings them back). A cache at stable addresses keeps them, its length
        and the graphs that read it: `_ensure_length` maps memory there again. Any other cache is freed with its
        graphs (`clear`), as are graphs that read fused weights without stable addresses."""
        if self.fused is not None:
            self.fused.release()
            if not self.fused.stable:
                self.drop_graphs()
        if self._memory is None:
            self.clear()
            return
        self._drop_rows()
        self._memory.release()

    def _drop_rows(self) -> None:
        self._row_slots, self._row_positions, self._row_prefixes = [], [], []
        self._shared = None
        self._free = list(range(self.max_slots))
        self.prefixes.clear()
        self._image_keys.clear()
        self._active.zero_()
        self._positions.zero_()

    def drop_graphs(self) -> None:
        """Forget captured graphs: the weights or the cache they point at may have moved."""
        self._graphs.clear()
        self._graph_pool = None
        self._graph_weights = None

    def weights_changed(self) -> None:
        """The weights were written: keep the graphs when every weight tensor is still where they were
        captured (updated in place: the hybrid engine's shared weights after an optimizer step,
        `load_weights_in_place`, a LoRA merge), else drop them. A graph reads its weights by address, so it
        replays the new values; re-capturing every graph after each update cost ~1 s a step of the 8-turn
        agent workload whenever the cache stayed allocated (`free_cache_engine=false`, asynchronous training)."""
        if self._graph_weights is not None and self._graph_weights != weight_layout(self.model):
            self.drop_graphs()
        if self.fused is not None:
            self.fused.refresh()

    def _fused_layers(self) -> list[LayerFused] | None:
        """What the steps' `fused` argument is: the layers' concatenated weights, or None."""
        return None if self.fused is None else self.fused.layers

    # ----- decoding --------------------------------------------------------------------------------
    @torch.inference_mode()
    def compact_rows(self) -> None:
        """Move running rows out of slots at or past the bucket their number needs, each swapped with a lower
        slot that runs nothing (free, or parked: the prefix moves up with its keys and values), so a decode
        step computes and attends over about as many slots as rows run. Without it the slowest answer of a
        GRPO step decoded alone at the price of every slot up to its own: ~10 ms a token on an H100 for the
        last of 256 rows of SmolLM2-135M in float32.

        Safe between steps launched ahead: the swaps are queued on the device after the step in flight, whose
        results already travel to the host by their old slots."""
        if not self._row_slots:
            return
        target = self._bucket(len(self._row_slots))
        if self._bucket(max(self._row_slots) + 1) <= target:
            return
        running = set(self._row_slots)
        lower = iter(slot for slot in range(target) if slot not in running)
        up = {low: high for high, low in ((s, next(lower)) for s in self._row_slots if s >= target)}
        down = {high: low for low, high in up.items()}
        reach = 1 + max(
            [
                position
                for slot, position in zip(self._row_slots, self._row_positions, strict=True)
                if slot in down
            ]
            + [self.prefixes.held(low) for low in up]
        )
        order = self._to_device(list(down) + list(up))
        source = self._to_device(list(up) + list(down))
        for cache in (*self.keys, *self.values):
            view = cache[:, :, :reach]
            view.index_copy_(0, order, view.index_select(0, source))
        for state in (
            self._token_ids, self._positions, self._active, self._temperature, self._top_p, self._top_k,
            self._seeds, self._drawn, self._limits, self._rope_offsets,
        ):  # fmt: skip
            state.index_copy_(0, order, state.index_select(0, source))
        self._row_slots = [down.get(slot, slot) for slot in self._row_slots]
        self.prefixes.relabel({**up, **down})
        self._free = [up.get(slot, slot) for slot in self._free]
        heapq.heapify(self._free)
        self._image_keys = {down.get(slot, slot): key for slot, key in self._image_keys.items()}
        self.counters["compacted_rows"] += len(down)

    @torch.inference_mode()
    def decode(self, token_ids: list[int]) -> torch.Tensor:
        """Feed each row's pending token; return logits (rows, V) in row order."""
        self.compact_rows()
        bucket = self._bucket(max(self._row_slots) + 1)
        ids, positions = [0] * bucket, [self.sink] * bucket
        for slot, token, position in zip(self._row_slots, token_ids, self._row_positions, strict=True):
            ids[slot], positions[slot] = token, position
        self._token_ids[:bucket].copy_(self._to_device(ids))
        self._positions[:bucket].copy_(self._to_device(positions))
        if self.cuda_graphs:
            graph, logits = self._graph(bucket)
            self._launcher.launch(graph)
        else:
            logits = self._step(bucket)
        self._row_positions = [p + 1 for p in self._row_positions]
        return logits.index_select(0, self._to_device(self._row_slots))

    def _set_slots(self, slots: list[int], target: torch.Tensor, values: list) -> None:
        target.index_copy_(0, self._to_device(slots), self._to_device(values, target.dtype))

    def _to_device(self, values: list | torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """`values` on the engine's device without waiting for it: on CUDA through a reused pinned buffer and
        an asynchronous copy (`PinnedStaging`). A plain `torch.tensor(..., device=cuda)` copies from pageable
        memory, which waits for every kernel queued before it: each retired row then stalled the host until the
        decode step launched one step ahead had finished, and the host could not prepare the next step."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host.to(self.device)
        return self._staging.to_device(host)

    # ----- decoding without a host round trip ------------------------------------------------------
    def load_rows(self, start: int, sampling: SlotSampling, tokens: list[int] | None = None) -> None:
        """Write rows `start`.. (their sampling settings, draw counters and cache positions; their pending
        tokens when given) to the device state `decode_sampled` and `draw_first` read."""
        slots = self._row_slots[start:]
        self._set_slots(slots, self._positions, self._row_positions[start:])
        self._set_slots(slots, self._temperature, sampling.temperature)
        self._set_slots(slots, self._top_p, sampling.top_p)
        self._set_slots(slots, self._top_k, sampling.top_k)
        self._set_slots(slots, self._seeds, [as_int64(seed) for seed in sampling.seeds])
        self._set_slots(slots, self._drawn, sampling.drawn)
        self._set_slots(slots, self._limits, sampling.limits)
        if tokens is not None:
            self._set_slots(slots, self._token_ids, tokens)

    @torch.inference_mode()
    def draw_first(self, logits: torch.Tensor, start: int, needs: tuple[bool, bool]) -> DeviceDraw:
        """Draw the first token of rows `start`.. from their prefill `logits` (rows, V), on the device."""
        slots = self._row_slots[start:]
        index = self._to_device(slots)
        chosen, logprob = self._sample_on_device(
            logits,
            *(state.index_select(0, index) for state in (self._temperature, self._top_p, self._top_k)),
            self._seeds.index_select(0, index),
            self._drawn.index_select(0, index),
            needs,
        )
        self._token_ids.index_copy_(0, index, chosen)
        self._drawn.index_add_(0, index, torch.ones_like(chosen))
        results = torch.zeros(1, 2, self.max_slots, dtype=torch.float64, device=self.device)
        results[0, 0].index_copy_(0, index, chosen.double())
        results[0, 1].index_copy_(0, index, logprob.double())
        return self._to_host(results, slots)

    @torch.inference_mode()
    def decode_sampled(self, needs: tuple[bool, bool], steps: int = 1) -> DeviceDraw:
        """Feed every slot its token from the device, draw the next one there, and make it the slot's next
        input, `steps` times over; returns the rows' draws on their way to the host (nothing here waits for the
        device). A row that reaches its limit within the steps stops advancing; one that ends otherwise (a stop
        token) decodes on to the last step, and the host drops what it drew after its end.

        Under CUDA graphs the draws and the state updates are part of the captured step: one replay instead of
        the ~40 small kernels sampling launches from Python (~1 ms a step on an H100 host), and one replay
        for all `steps` (vLLM's multi-step scheduling, `num_scheduler_steps`): the host's work between steps,
        and its waits for the GIL, come once per `steps` decode steps."""
        self.compact_rows()
        bucket = self._bucket(max(self._row_slots) + 1)
        if self.cuda_graphs:
            graph, results = self._sampled_graph(bucket, needs, steps)
            self._launcher.launch(graph)
        else:
            results = self._sampled_steps(bucket, needs, steps)
        # At most: a row at its limit stopped earlier, and the host retires it before its position is read.
        self._row_positions = [p + steps for p in self._row_positions]
        return self._to_host(results, list(self._row_slots))

    def _sampled_steps(
        self, bucket: int, needs: tuple[bool, bool], steps: int, advance: bool = True
    ) -> torch.Tensor:
        """`steps` decode steps, each drawing and (with `advance`) making each slot's draw its next input;
        (steps, 2, bucket) float64 results. Without `advance` nothing but the cache changes (the graph's
        warm-up). Without graphs every step reads as far as the last one needs."""
        span = None if self.cuda_graphs else self._span(steps)
        return torch.stack([self._sampled_step(bucket, needs, advance, span) for _ in range(steps)])

    def _sampled_step(
        self, bucket: int, needs: tuple[bool, bool], advance: bool, span: int | None
    ) -> torch.Tensor:
        logits = self._step(bucket, span)
        drawn = self._drawn[:bucket]
        seeds = self._seeds[:bucket]
        state = (self._temperature[:bucket], self._top_p[:bucket], self._top_k[:bucket])
        chosen, logprob = self._sample_on_device(
            logits, *state, seeds, drawn if advance else drawn.clone(), needs
        )
        if advance:
            moving = self._active[:bucket] * (drawn < self._limits[:bucket])
            self._token_ids[:bucket].copy_(chosen)
            self._positions[:bucket] += moving
            drawn += moving
        return torch.stack([chosen.double(), logprob.double()])

    def _sample_on_device(self, logits: torch.Tensor, *settings: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_on_device(logits, *settings)`, never choosing the `_never` tokens; the logprob stays the
        unmasked one (as the host's `select_tokens` blocks tokens). settings[0] is the rows' temperature."""
        if self._never is None:
            return sample_on_device(logits, *settings)
        chosen, _ = sample_on_device(logits.index_fill(1, self._never, float("-inf")), *settings)
        return chosen, policy_logprob(logits, settings[0], chosen)

    def _to_host(self, results: torch.Tensor, slots: list[int]) -> DeviceDraw:
        if self.device.type != "cuda":
            return DeviceDraw(slots, results, None)
        host, ready = self._staging.to_host(results)
        return DeviceDraw(slots, host, ready)

    def _step(self, bucket: int, span: int | None = None, shared: SharedPrefix | None = None) -> torch.Tensor:
        """The decode step over slots 0..bucket-1; without graphs over `span` cache positions (default
        `_span`), its rows sharing a prefix as `shared` says (default: as they do, `_shared_prefix`)."""
        offsets = self._rope_offsets[:bucket] if self.images else None
        ids, positions = self._token_ids[:bucket], self._positions[:bucket]
        if self.cuda_graphs:  # one graph per bucket reads the whole cache length
            return self._decode_step(
                self.model, self.keys, self.values, ids, positions, offsets, fused=self._fused_layers()
            )
        if shared is None and (shared := self._shared_prefix(bucket)) is not None:
            self.counters["shared_prefix_decodes"] += 1
        return self._decode_step(
            self.model,
            self.keys,
            self.values,
            ids,
            positions,
            offsets,
            span or self._span(),
            fused=self._fused_layers(),
            **({"shared": shared} if shared is not None else {}),
        )

    def _shared_prefix(self, bucket: int) -> SharedPrefix | None:
        """How this step's rows share a prompt prefix (`plan_shared_prefix`), planned when the rows or their
        slots change; None off the float32 CPU step. The compiled step takes the plan's sizes and length
        symbolically once `compile_now` has traced them (`_plans_compiled`): reading each row's own copy
        instead, its attention was most of a 32-row step (`benchmarks/shared_prefix_decode.py
        --compile-decode`)."""
        if not self._shares_prefixes or (self._decode_step is not decode_step and not self._plans_compiled):
            return None
        key = (bucket, *self._row_slots)
        if self._shared is None or self._shared[0] != key:
            plan = plan_shared_prefix(self._row_slots, self._row_prefixes, bucket, BLOCK_TOKENS, self.device)
            self._shared = (key, plan)
        return self._shared[1]

    def _span(self, steps: int = 1) -> int:
        """Cache positions the next `steps` decode steps must read: past every running row's position at the
        last of them (a multiple of `SPAN_STEP`). Without graphs the step's shapes may change each time;
        attention over the whole cache would cost as if every row were as long as the longest allowed."""
        reach = max(self._row_positions, default=0) + steps
        return min(self.length, -(-reach // SPAN_STEP) * SPAN_STEP)

    def _bucket(self, needed: int) -> int:
        """Rows a step computes: under CUDA graphs a power of two (one graph each, few graphs); without them
        the next multiple of `MIN_BUCKET`, since every row beyond `needed` is work for nothing (with powers of
        two up to half the step), while a few more rows keeping one shape keep a row's results the same."""
        if self.cuda_graphs:
            return min(self.max_slots, max(MIN_BUCKET, _next_power_of_two(needed)))
        return min(self.max_slots, -(-needed // MIN_BUCKET) * MIN_BUCKET)

    def _graph(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a decode step over `bucket` slots, captured with the current inputs (logits out).

        Warm-up and capture run the step on the inputs already in place, so the keys and values they write
        are the ones the replay writes again.
        """
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(lambda: self._warm_up(bucket), lambda: self._step(bucket))
        return self._graphs[bucket]

    def _sampled_graph(
        self, bucket: int, needs: tuple[bool, bool], steps: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of `_sampled_steps` (decode, draw, advance the slots' state, `steps` times): (steps, 2,
        bucket) results out.

        Its warm-up draws without advancing anything, so the replay that follows the capture is the step's
        only draw."""
        key = (bucket, needs, steps)
        if key not in self._graphs:

            def warm_up() -> None:
                self._warm_up(bucket)
                self._sampled_steps(bucket, needs, 1, advance=False)

            self._graphs[key] = self._capture(warm_up, lambda: self._sampled_steps(bucket, needs, steps))
        return self._graphs[key]

    def _capture(
        self, warm_up: Callable[[], object], step: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run `warm_up` on a side stream, then capture `step` into a graph on the shared pool; the graph and
        `step`'s output (rewritten by each replay)."""
        start = time.perf_counter()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        if not self._graphs:
            self._graph_weights = weight_layout(self.model)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with cudnn_attention_for_capture():  # a training worker leaves it out; a graph builds its plan once
            with torch.cuda.stream(side):
                warm_up()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a trainer in another thread (asynchronous training) may use the GPU during a capture.
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                output = step()
        self.setup_s["graph_capture_s"] += time.perf_counter() - start
        return graph, output

    def _warm_up(self, bucket: int, span: int | None = None) -> None:
        """One decode step outside capture (it compiles the step the first time); `span` as `_step`'s."""
        self._compiled_or_plain("decode", lambda: self._step(bucket, span))

    def _compiled_or_plain(self, step: str, run: Callable[[], object]) -> None:
        """`run` a step (`decode` or `extend`) outside capture; if its compilation fails, fall back to the plain
        step, loudly, and run that, so a machine without a working Triton still serves under graphs."""
        plain = {"decode": decode_step, "extend": extend_step, "flash": flash_extend_step}[step]
        try:
            run()
        except Exception:
            if getattr(self, f"_{step}_step") is plain:
                raise
            logger.warning(
                "embedded engine: torch.compile of the %s step failed; running the plain step "
                "(set actor_rollout_ref.rollout.compile_decode=false to skip compiling)",
                step,
                exc_info=True,
            )
            setattr(self, f"_{step}_step", plain)
            run()

    def compile_now(self) -> float:
        """Compile the decode and extend steps before any request arrives; returns the seconds it took (0:
        nothing to do).

        A fresh process compiles on its first decode (13-18 s for a 24-layer model on an H100; 30-80 s when the
        whole step was compiled; all of it Python) while the first rollouts wait, and that wait counted against
        `agent.timeout`: a slow host timed out every episode of the first step. The steps run on placeholders in
        the free slots (`_extend_placeholder`; a decode step's token 0 at position 0, which no row owns), and the
        cache they needed is freed again if no row held one. The cache is allocated as `admit` allocates it,
        outside inference mode: the compiled step guards on its inputs' dispatch keys, and a cache of inference
        tensors made the first real decode compile all over again.
        """
        if self._decode_step is decode_step or self._row_slots:
            return 0.0
        start = time.perf_counter()
        had_cache = self.length > 0
        for length in (MIN_LENGTH, 2 * MIN_LENGTH):  # the second compiles the cache length symbolic
            self._ensure_length(min(length, self.max_model_len))
            # as `decode` and `decode_sampled` run it, and with the attention kernels of `_capture`; on the CPU
            # over two spans, which makes the span symbolic too (the eager step reads `_span` positions)
            with torch.inference_mode(), cudnn_attention_for_capture():
                self._warm_up(MIN_BUCKET, None if self.cuda_graphs else SPAN_STEP * length // MIN_LENGTH)
        if self._shares_prefixes and self.max_slots >= MIN_BUCKET:  # (the placeholders need the slots)
            with torch.inference_mode():
                for plan in placeholder_plans(MIN_BUCKET, BLOCK_TOKENS, self.device):
                    self._compiled_or_plain(
                        "decode", functools.partial(self._step, MIN_BUCKET, SPAN_STEP, plan)
                    )
            self._plans_compiled = True
        # The extend step first over a span shorter than the cache, then over all of it. Traced first with the
        # two equal, Dynamo gave both one symbol, and the graph then read a longer cache with the span's strides
        # (Inductor's input check stopped it on an H200).
        with torch.inference_mode(), cudnn_attention_for_capture():
            for span in sorted({min(MIN_LENGTH, self.length), self.length}) if self._extend_compiled else ():
                self._compiled_or_plain("extend", functools.partial(self._extend_placeholder, span))
            if self._flash_step is not None:
                self._compiled_or_plain("flash", self._flash_placeholder)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not had_cache:
            self.clear()
        return time.perf_counter() - start

    def _extend_placeholder(self, span: int) -> torch.Tensor:
        """An extend step of `MIN_BUCKET` rows x `EXTEND_MAX_TOKENS` tokens, all at position span-1 of the first
        slots, which no row owns yet (what `compile_now` compiles the extend step on: at the engine's start). Its
        inputs are made outside inference mode, as `_extend_call`'s are: the compiled step guards on that."""
        shape = (MIN_BUCKET, EXTEND_MAX_TOKENS)
        with torch.inference_mode(False):
            tokens = torch.zeros(shape, dtype=torch.long, device=self.device)
            positions = torch.full(shape, min(span, self.length) - 1, dtype=torch.long, device=self.device)
            slots = torch.arange(MIN_BUCKET, device=self.device)
            last = torch.zeros(MIN_BUCKET, dtype=torch.long, device=self.device)
            offsets = torch.zeros(MIN_BUCKET, dtype=torch.long, device=self.device) if self.images else None
        return self._extend_step(
            self.model, self.keys, self.values, slots, tokens, positions, last, span, offsets,
            fused=self._fused_layers(),
        )  # fmt: skip

    def _flash_placeholder(self) -> torch.Tensor:
        """A `flash_extend_step` of `MIN_BUCKET` rows of `WIDTH` padding tokens (written at the sink of slot 0,
        which no row owns yet): what `compile_now` compiles it on. Inputs made outside inference mode, as
        `_flash_call`'s are."""
        tokens = MIN_BUCKET * WIDTH
        inputs, sequences = packed_rows([], tokens, MIN_BUCKET, self.shape.kv_heads, self.length, self.sink)
        with torch.inference_mode(False):
            ids, positions, slots, last = inputs.to(self.device).split([tokens, tokens, tokens, MIN_BUCKET])
            sequences_at = flash_sequences(tokens, MIN_BUCKET)
            rows = FlashRows.empty(sequences_at, WIDTH, self.length, self.device)
        rows.fill_(sequences.to(self.device))
        shaped = (t.view(-1, WIDTH) for t in (slots, ids, positions))
        return self._flash_step(
            self.model, self.keys, self.values, *shaped, last, rows, fused=self._fused_layers()
        )

    # ----- memory ----------------------------------------------------------------------------------
    def _ensure_length(self, needed: int) -> None:
        if self._memory is not None and not self._memory.mapped:
            start = time.perf_counter()
            self._memory.restore()  # after a sleep: zeroed pages at the addresses the graphs read
            self.setup_s["cache_alloc_s"] += time.perf_counter() - start
        if needed <= self.length:
            return
        start = time.perf_counter()
        length = min(self.max_model_len, max(MIN_LENGTH, _next_power_of_two(needed)))
        size = (self.max_slots, self.shape.kv_heads, length, self.shape.head_dim)
        self._check_memory(length)
        memory, tensors = self._allocate(size, 2 * self.shape.layers)
        for new, old in zip(tensors, self.keys + self.values, strict=False):
            new[:, :, : self.length] = old
        if self._memory is not None:
            self._memory.free()  # waits for the copies
        self.keys, self.values = tensors[: self.shape.layers], tensors[self.shape.layers :]
        self._memory, self.length = memory, length
        busy = set(self._row_slots)
        idle = [slot for slot in range(self.max_slots) if slot not in busy]
        if idle:
            self._set_slots(idle, self._positions, [self.sink] * len(idle))
        self.drop_graphs()
        self.setup_s["cache_alloc_s"] += time.perf_counter() - start
        # Rebuilt after every sleep: say it once per size, not at every training step.
        logger.log(
            logging.INFO if length > self._largest_logged else logging.DEBUG,
            "embedded engine: KV cache of %d slots x %d positions (%.2f GiB)",
            self.max_slots,
            length,
            self.max_slots * length * self.shape.bytes_per_token() / 2**30,
        )
        self._largest_logged = max(self._largest_logged, length)

    def _allocate(self, size: tuple[int, ...], count: int) -> tuple[StableMemory | None, list[torch.Tensor]]:
        """`count` zeroed cache tensors of `size`: under CUDA graphs in one `StableMemory` when the driver
        offers it (each tensor its own base, so a compiled layer sees the same kind of input in every layer),
        else from PyTorch's allocator."""
        each = torch.Size(size).numel() * self.shape.dtype.itemsize
        memory = stable_memory(count * each, self.device, "the KV cache") if self.cuda_graphs else None
        if memory is None:
            return None, [torch.zeros(size, dtype=self.shape.dtype, device=self.device) for _ in range(count)]
        return memory, [memory.tensor(i * each, each).view(self.shape.dtype).view(size) for i in range(count)]

    def _check_memory(self, length: int) -> None:
        if self.device.type != "cuda":
            return
        needed = self.max_slots * length * self.shape.bytes_per_token()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        held = self.max_slots * self.length * self.shape.bytes_per_token()  # freed once the copy is done
        if needed > CACHE_SHARE_OF_FREE_MEMORY * free:
            raise RuntimeError(
                f"the embedded engine's KV cache for {self.max_slots} sequences x {length} positions needs "
                f"{needed / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB are free (besides {held / 2**30:.1f} GiB "
                f"held now): lower actor_rollout_ref.rollout.max_num_seqs or data.max_response_length"
            )

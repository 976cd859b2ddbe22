"""The embedded engine: continuous batching over a transformers causal LM, on CPU or CUDA.

Choice of batching: transformers 5's own `ContinuousBatchingManager` (paged KV cache) was
evaluated first and not used. Measured on CPU (tiny:qwen2, 64 prompts x 64 sampled tokens, one
thread), `model.generate_batch(..., ContinuousBatchingConfig(return_logprobs=True))` made ~660
tokens/s (manager start-up included). Beyond speed, it does not fit the API:
(1) its sampling settings (temperature, top-p, top-k, do_sample) are per manager, and our API
and the OpenAI protocol take them per request (train and validation differ, agents set their
own); (2) its logprobs are `log(softmax(processed scores))`, i.e. after top-p too,
while RL needs the logprob of the trained policy, and `log(softmax)` underflows where `log_softmax` does not;
(3) it samples with the global RNG, so per-request seeds cannot be honoured; (4) it has no stop
strings. Instead a compact scheduler of our own runs in a background thread: between decode steps
it admits waiting requests (each prompt prefilled once, its KV shared by its `n` completions) and
retires finished rows. For Llama-family models and Qwen vision-language models the running batch lives in
a preallocated slot cache and each decode step is one CUDA graph replay on GPU (`_slot_batch.py`,
`_slot_decode.py`; images enter at prefill, `vision.py`); other models use transformers' `DynamicCache`
(`_batch.py`), with text prompts only. Each row samples with its own settings
and seed, all rows in one vectorised draw (`_sampling.py`): per-request seeds give the same tokens
whatever else is in the batch, and greedy (temperature 0) equals `model.generate`'s greedy. On the
slot path, rows without grammars, blocked tokens or top logprobs draw on the device and the scheduler
runs one step ahead: it launches step k+1 before it reads step k's tokens (`_step_on_device`).

Logprobs are log softmax(z / T) at the sampled token (T the request's temperature, 1 when greedy; before
top-k and top-p), matching a teacher-forced forward pass of the same weights with its logits divided by T,
which is what the trainer computes. Weight updates and LoRA merges take the step lock,
so they land between two decode steps; sequences still running continue with the new weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from agentrl.data.images import load_image_processor
from agentrl.rollout.engines._batch import DynamicBatch
from agentrl.rollout.engines._openmp import release_openmp_workers
from agentrl.rollout.engines._parked_weights import ParkedWeights
from agentrl.rollout.engines._prefix_cache import BLOCK_TOKENS, block_hashes
from agentrl.rollout.engines._request_metrics import RequestMetrics
from agentrl.rollout.engines._requests import Detokenizer, Request, Sequence, StreamEvent, build_sequences
from agentrl.rollout.engines._sampling import RowSampling, filters_needed, select_tokens
from agentrl.rollout.engines._slot_batch import PREFILL_PATHS, DeviceDraw, SlotBatch, SlotSampling
from agentrl.rollout.engines._slot_decode import slot_decode_unsupported
from agentrl.rollout.engines._weights import LoraMerger, fingerprint_state_dict, load_weights_in_place
from agentrl.rollout.engines.constraints import Constraint, GrammarCompiler, advance, fill_bitmasks
from agentrl.rollout.engines.vision import (
    ImageInputs,
    check_image_prompt,
    is_vision_language,
    placeholder_token_ids,
)
from agentrl.types import GenerationOutput, SamplingParams

__all__ = ["EmbeddedEngine", "StreamEvent", "build_embedded_engine", "fingerprint_state_dict"]

logger = logging.getLogger(__name__)
MAX_TOP_LOGPROBS = 20
ADMISSION_WINDOW_S = 0.05
"""Longest a waiting request is held back while rows run, to batch arrivals into one prefill. Each admission is
a forward that stalls every running row, with a cost that hardly depends on its size: on an H100 host, the
8-turn agent workload (128 episodes, ~100 next turns a second) made 317 prefills a step of ~3 turns each with
a 20 ms window and admission at every 10 ms pause."""
ADMIT_SHARE_OF_RUNNING = 0.25
"""While rows run, waiting sequences are admitted at once when they number this share of the running rows (and
at least `ADMIT_MIN_SEQS`): a prefill that large is worth its stall."""
ADMIT_MIN_SEQS = 8
IDLE_ADMISSION_WINDOW_S = 0.25
"""Longest the first request of a burst is held back by an idle engine (a rollout's requests come in a burst:
on an H100 host the 128 first calls of a GRPO step reached the engine over ~0.18 s, each after ~1.4 ms of
client, gateway and server Python; a shorter window split them into two prefills)."""
ARRIVALS_QUIET_S = 0.01
"""Arrivals have paused when the newest waiting request is this old: admit what came (a lone request waits
this long; the same burst showed gaps of 7 ms)."""


def _eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


def _recording_names(
    pairs: Iterable[tuple[str, torch.Tensor]], names: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` as they stream by, each name added to `names`."""
    for name, value in pairs:
        names.add(name)
        yield name, value


class EmbeddedEngine:
    """Serves one transformers model to concurrent async callers with continuous batching."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        image_processor: Any = None,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        owns_weights: bool = True,
        draw_on_device: bool = True,
        num_scheduler_steps: int = 1,
        enable_prefix_caching: bool = True,
        prefill_chunk_tokens: int = 8192,
        chunked_prefill: bool = True,
        prefix_max_weight_changes: int = 0,
        sleeps_between_steps: bool = False,
        fuse_projections: bool = True,
        threads: int | None = None,
    ) -> None:
        """`image_processor`: a vision-language model's (loaded from the model's folder when None).
        `cuda_graphs=False` decodes eagerly (verl's `enforce_eager`); it only matters on CUDA.
        `compile_decode`: the slot path's decode step goes through torch.compile before its graphs are captured.
        `owns_weights=False`: `model` is the trainer's own module (the hybrid engine shares one copy of the
        weights): sleep frees only the KV cache, and the weights stay where training needs them.
        `draw_on_device=False`: every row draws on the host's schedule (`_step_on_host`), one step at a time.
        `num_scheduler_steps` (vLLM's multi-step scheduling): rows drawing on the device decode this many steps
        per engine step, one graph replay and one read of their tokens for all of them; requests join and
        finished rows leave between them.
        `enable_prefix_caching` (vLLM's name): a finished sequence parks its slot so a prompt extending it (the
        agent's next turn) or sharing its prefix computes only the rest; identical prompts admitted together
        are computed once. `prefill_chunk_tokens`: the most prompt tokens one prefill forward computes.
        `chunked_prefill` (vLLM's `enable_chunked_prefill`): while rows decode, one engine step prefills at most
        `prefill_chunk_tokens` prompt tokens, so a long prompt (or a burst of them) is computed over several
        steps, a decode step of the running rows between each, instead of stalling them all for the whole of it.
        A prompt's parts wait in the prefix cache between steps, so it needs the slot path with prefix caching;
        an idle engine still prefills a whole admission at once (nothing decodes that it could stall).
        `prefix_max_weight_changes`: how many weight changes a parked prefix outlives (0: new weights forget
        every one; asynchronous training with `async_training.reuse_stale_prefixes` sets its staleness bound).
        `sleeps_between_steps`: the hybrid engine sleeps around every update; weights it owns move now to the
        addresses each wake brings them back to (`ParkedWeights.settle`), so graphs captured before the first
        sleep stay valid (else all were captured again after it: 0.85 s of a 20-step SmolLM2 run on an H200).
        `fuse_projections`: the slot path multiplies by concatenated copies of each layer's q/k/v and gate/up
        weights (`_fused_projections.py`), copied again at every weight change. `threads`: torch threads of the
        engine's own thread (CPU), set there (default: torch's setting when the thread first computes).

        The engine's thread compiles its steps (`compile_now`; the constructor waits for it): OpenMP keeps a pool
        of worker threads per thread that ran parallel work, and where the pools' threads outnumber the cores
        libgomp makes every worker sleep between parallel regions. On 2 cores, a compile on the constructor's
        thread left the engine's CPU waves ~2x slower (`benchmarks/openmp_pools.py`)."""
        self.model = model.eval()
        self.owns_weights = owns_weights
        self.draw_on_device = draw_on_device
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}")
        self.num_scheduler_steps = num_scheduler_steps
        self.image_processor = image_processor
        if image_processor is None and is_vision_language(model):
            self.image_processor = load_image_processor(model.name_or_path)
        self._placeholder_ids = placeholder_token_ids(model)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_max_weight_changes = prefix_max_weight_changes
        self.fuse_projections = fuse_projections
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.policy_version = 0
        self._device = next(model.parameters()).device
        self._detok = Detokenizer(tokenizer, _eos_token_ids(model, tokenizer))
        self._lora = LoraMerger()
        self._step_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: deque[tuple[Request, list[Sequence]]] = deque()
        self._rows: list[Sequence] = []
        self._batch = self._build_batch(cuda_graphs, compile_decode)
        self.chunked_prefill = (
            chunked_prefill and enable_prefix_caching and isinstance(self._batch, SlotBatch)
        )
        self._parked = ParkedWeights(
            model, self._device, stable=isinstance(self._batch, SlotBatch) and self._batch.cuda_graphs
        )
        """Where weights it owns wait while it sleeps (on CUDA)."""
        if sleeps_between_steps and owns_weights and self._device.type == "cuda":
            self._parked.settle()
        self._asleep = False
        self._closed = False
        self._admin_waiting = 0
        self._tokens_generated = 0
        self._sequences_finished = 0
        self._prefills = 0
        self._decode_steps = {"device": 0, "host": 0}
        """Decode steps that drew on the device one engine step ahead (`_step_on_device`, `num_scheduler_steps`
        each), and on the host's schedule."""
        self._busy_s = {"prefill_s": 0.0, "decode_s": 0.0, "host_s": 0.0}
        """Cumulative scheduler time: prefill and decode forwards with sampling (until the ids reach the host),
        and the per-row Python work around them (settings, stop checks, events)."""
        self._recent: deque[tuple[float, int]] = deque()
        self._metrics = RequestMetrics(self.max_model_len)
        """Finished requests' latencies, token counts and finish reasons, for `GET /metrics`
        (`_request_metrics.py`)."""
        self._grammars: GrammarCompiler | None = None
        self._in_flight: list[tuple[list[Sequence], DeviceDraw, str]] = []
        """Draws launched on the device and not read yet, oldest first, with the phase (`_busy_s` key) that
        waiting for them counts as (`_step_on_device`)."""
        self._rows_on_device = False
        """Whether the device holds every row's pending token, position and draw counter."""
        self._threads = threads
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self.close()
            raise self._start_error

    def _start_on_engine_thread(self) -> None:
        """What the engine's thread does first: take its torch threads and compile the steps."""
        try:
            if self._threads is not None:
                torch.set_num_threads(self._threads)
            if isinstance(self._batch, SlotBatch):
                seconds = self._batch.compile_now()
                if seconds:
                    logger.info("embedded engine: compiled its steps in %.1f s", seconds)
        except BaseException as error:  # raised in the constructor's thread
            self._start_error = error
        finally:
            self._started.set()

    def _build_batch(self, cuda_graphs: bool, compile_decode: bool) -> SlotBatch | DynamicBatch:
        reason = slot_decode_unsupported(self.model)
        if reason is not None:
            logger.info("embedded engine: DynamicCache decoding (%s)", reason)
            if self.image_processor is not None:  # only the slot path's prefill reads pixels
                logger.warning("embedded engine: images are refused (%s)", reason)
                self.image_processor = None
            return DynamicBatch(self.model)
        return SlotBatch(
            self.model,
            max_slots=self.max_num_seqs,
            max_model_len=self.max_model_len,
            cuda_graphs=cuda_graphs,
            compile_decode=compile_decode,
            prefix_caching=self.enable_prefix_caching,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            fuse_projections=self.fuse_projections,
        )

    # ----- generation -------------------------------------------------------------------------
    @property
    def accepts_images(self) -> bool:
        """Whether prompts may carry images (a vision-language model with its image processor)."""
        return self.image_processor is not None

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        top_logprobs: int = 0,
        images: ImageInputs | None = None,
        constraint: Constraint | None = None,
    ) -> list[GenerationOutput]:
        """`params.n` completions of `prompt_ids` (token ids, logprobs, text, finish reason).

        `images`: the pixels behind the prompt's image pads (`vision.build_image_prompt`).
        `constraint`: the format the completions must follow (`constraints.build_constraint`).
        """
        outputs: list[GenerationOutput | None] = [None] * params.n
        request = self._submit(
            prompt_ids, params, top_logprobs, stream=False, images=images, constraint=constraint
        )
        async for event in self._drain(request):
            outputs[event.index] = event.output
        return outputs  # type: ignore[return-value]

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        top_logprobs: int = 0,
        images: ImageInputs | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Like `generate`, but yields each completion's new tokens after every engine step (one decode step, or
        `num_scheduler_steps` of them when its rows draw on the device: their tokens come as one event).

        Validates and enqueues at once (ValueError before any event), so a server can answer 400
        before it starts streaming. Call it from inside the running event loop.
        """
        request = self._submit(
            prompt_ids, params, top_logprobs, stream=True, images=images, constraint=constraint
        )
        return self._drain(request)

    async def _drain(self, request: Request) -> AsyncIterator[StreamEvent]:
        remaining = request.params.n
        try:
            while remaining:
                batch = await request.queue.get()
                if isinstance(batch, BaseException):
                    raise batch
                for event in batch:
                    remaining -= event.finish_reason is not None
                    yield event
        finally:
            if remaining:
                request.cancelled = True

    def _submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        top_logprobs: int,
        stream: bool,
        images: ImageInputs | None = None,
        constraint: Constraint | None = None,
    ) -> Request:
        """Validate (ValueError names the problem; the server turns it into a 400) and enqueue."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)"
            )
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} is above the engine's max_num_seqs={self.max_num_seqs}")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")
        if images is not None:
            if not self.accepts_images:
                raise ValueError("images were sent, but this engine serves a text-only model")
            image_token = int(self.model.config.image_token_id)
            check_image_prompt(prompt_ids, images, image_token, int(self.image_processor.merge_size))
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        request = Request(
            prompt_ids=[int(t) for t in prompt_ids],
            params=params,
            top_logprobs=top_logprobs,
            max_new_tokens=max_new,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            stream=stream,
            images=images,
            constraint=constraint,
        )
        request.draws_on_device = (
            top_logprobs == 0 and constraint is None and not self._blocked_below_min_tokens_of(params)
        )
        if self.enable_prefix_caching and images is None:
            request.prompt_hashes = block_hashes(request.prompt_ids)
        seqs = build_sequences(request)
        self._attach_matchers(seqs)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._waiting.append((request, seqs))
            self._cond.notify()
        return request

    # ----- scheduler thread -------------------------------------------------------------------
    def _run(self) -> None:
        self._start_on_engine_thread()
        hold = None
        while True:
            with self._cond:
                released = False
                while not self._closed and (
                    self._admin_waiting or (not self._rows and (self._asleep or not self._waiting))
                ):
                    if self._asleep and not released:  # the trainer's turn: the cores are its (`_openmp.py`)
                        released = release_openmp_workers()
                    self._cond.wait()
                if hold is not None and not self._rows and not self._closed:
                    self._cond.wait(timeout=hold)  # an idle engine gathering a burst (a new arrival wakes it)
                if self._closed:
                    break
            try:
                with self._step_lock:
                    hold = self._step()
            except Exception as error:  # a failed step costs its requests, not the engine
                hold = None
                logger.exception("embedded engine step failed")
                self._fail_running(error)
        self._fail_running(RuntimeError("engine closed"))

    def _admission_hold(self, free: int) -> float | None:
        """Seconds to keep waiting requests back (None: admit now). Caller holds `_cond`.

        Each admission is one prefill forward (tens of ms on GPU, launch-bound whatever its size) that also
        stalls every running row, and the requests of a rollout arrive as a burst over a fraction of a
        second: admitting as they came made one prefill per arrival. On an idle engine requests are admitted
        together once they would fill every free slot, the arrivals pause (`ARRIVALS_QUIET_S`) or the first
        has waited `IDLE_ADMISSION_WINDOW_S`; while rows run, once they number `ADMIT_SHARE_OF_RUNNING` of the
        running rows (at least `ADMIT_MIN_SEQS`) or the oldest has waited `ADMISSION_WINDOW_S` (agents' next
        turns arrive one by one as their tools return: a pause says nothing there). Filling the free slots
        does not count while rows run: with `max_num_seqs` equal to the episodes, every free slot is an
        episode between turns, so each next turn filled them as it came (~290 prefills of ~3 turns a step of
        the 8-turn benchmark on an H100; ~100 without the rule, generation 8.2-9.5 s -> 7.3 s).
        """
        waiting = sum(len(seqs) for _, seqs in self._waiting)
        if not self._waiting or (waiting >= free and not self._rows):
            return None
        now = time.monotonic()
        if self._rows:
            if waiting >= max(ADMIT_MIN_SEQS, int(ADMIT_SHARE_OF_RUNNING * len(self._rows))):
                return None
            left = ADMISSION_WINDOW_S - (now - self._waiting[0][0].arrived)
        else:
            left = min(
                IDLE_ADMISSION_WINDOW_S - (now - self._waiting[0][0].arrived),
                ARRIVALS_QUIET_S - (now - self._waiting[-1][0].arrived),
            )
        return left if left > 0 else None

    def _admit(self) -> tuple[list[tuple[Request, list[Sequence]]], Request | None, float | None]:
        """Waiting requests that fit, once `_admission_hold` lets them in; the first waiting request when it is
        too long to prefill whole in this step (`chunked_prefill`: it stays waiting, a part of it is computed);
        and how long admission holds the waiting ones back."""
        admitted: list[tuple[Request, list[Sequence]]] = []
        with self._cond:
            free = self.max_num_seqs - len(self._rows)
            hold = self._admission_hold(free)
            if hold is not None:
                return admitted, None, hold
            budget = self.prefill_chunk_tokens if self.chunked_prefill and self._rows else None
            budgeted: set[int] = set()
            while self._waiting and not self._asleep:
                request, seqs = self._waiting[0]
                if request.cancelled or request.loop.is_closed():  # nobody can receive its tokens
                    self._waiting.popleft()
                    self._count_finished("abort", seqs)
                    continue
                if len(seqs) > free:
                    break
                if budget is not None and request.images is None:
                    left = self._tokens_to_prefill(request, budgeted)
                    if left > budget:
                        return admitted, (None if admitted else request), None
                    budget -= left
                admitted.append(self._waiting.popleft())
                free -= len(seqs)
        return admitted, None, None

    def _step(self) -> float | None:
        """One decode step of the running rows and/or one prefill of admitted requests; returns how long
        admission holds the waiting ones back when nothing ran (the scheduler then waits that long)."""
        admitted, part_of, hold = self._admit()
        try:
            if self._can_draw_on_device(admitted):
                self._step_on_device(admitted)
            else:
                self._read_in_flight()
                self._step_on_host(admitted)
            if part_of is not None:
                self._prefill_part(part_of)
        except Exception as error:  # admitted requests not yet running: _fail_running would not reach them
            running = {id(seq.request) for seq in self._rows}
            failed = [(request, seqs) for request, seqs in admitted if id(request) not in running]
            if part_of is not None:
                with self._cond:
                    parts = [seq for request, seqs in self._waiting if request is part_of for seq in seqs]
                    self._waiting = deque(item for item in self._waiting if item[0] is not part_of)
                failed.append((part_of, parts))
            self._count_finished("error", [seq for _, seqs in failed for seq in seqs])
            self._deliver_all([(request, error) for request, _ in failed])
            raise
        return hold

    def _tokens_to_prefill(self, request: Request, budgeted: set[int]) -> int:
        """Prompt tokens admitting `request` would compute: past what a parked slot holds, and past the prefix it
        shares with prompts admitted before it in this step (`budgeted`: their block hashes, which it joins), as
        `SlotBatch.admit` computes a GRPO group's prompt or agents' common system prompt once."""
        prompt, hashes = request.prompt_ids, request.prompt_hashes or []
        shared = next((k * BLOCK_TOKENS for k in range(len(hashes), 0, -1) if hashes[k - 1] in budgeted), 0)
        budgeted.update(hashes)
        return len(prompt) - max(shared, self._batch.cached_tokens(prompt, hashes))

    def _prefill_part(self, request: Request) -> None:
        """Compute the next `prefill_chunk_tokens` of a waiting prompt too long for one step (after this step's
        decode launched); it is admitted once what is left fits in a step. Never its last token: the admission
        computes that one, whose logits start the answer."""
        prompt = request.prompt_ids
        end = min(
            len(prompt) - 1,
            self._batch.cached_tokens(prompt, request.prompt_hashes) + self.prefill_chunk_tokens,
        )
        reserve = len(prompt) + request.max_new_tokens
        request.admitted_at = request.admitted_at or time.monotonic()
        request.computed_in_parts += self._batch.prefill_part(prompt[:end], reserve)

    def _can_draw_on_device(self, admitted: list[tuple[Request, list[Sequence]]]) -> bool:
        return (
            self.draw_on_device
            and isinstance(self._batch, SlotBatch)
            and all(seq.request.draws_on_device for seq in self._rows)
            and all(request.draws_on_device for request, _ in admitted)
        )

    def _step_on_device(self, admitted: list[tuple[Request, list[Sequence]]]) -> None:
        """Launch the next decode step, then read the previous one's tokens while the device runs it.

        Rows that finished at the step being read were already fed to the launched one: its token for them
        is dropped. Admitted rows draw their first token on the device too; it is read at the next step."""
        batch: SlotBatch = self._batch  # type: ignore[assignment]
        if self._rows:
            start = time.perf_counter()
            if not self._rows_on_device:
                batch.load_rows(0, self._slot_sampling(self._rows), [seq.pending for seq in self._rows])
            launched = batch.decode_sampled(self._filters(self._rows), self.num_scheduler_steps)
            self._decode_steps["device"] += self.num_scheduler_steps
            self._busy_s["decode_s"] += time.perf_counter() - start
            self._read_in_flight(then_keep=(self._rows, launched, "decode_s"))
        if admitted:
            start = time.perf_counter()
            logits, new_rows = self._prefill(admitted)
            first = len(self._rows)
            self._rows = self._rows + new_rows
            batch.load_rows(first, self._slot_sampling(new_rows))
            first_draw = batch.draw_first(logits, first, self._filters(new_rows))
            self._in_flight.append((new_rows, first_draw, "prefill_s"))
            self._busy_s["prefill_s"] += time.perf_counter() - start
        self._rows_on_device = True
        if not self._rows:
            self._read_in_flight()  # every row of the launched step finished: nothing to wait for later

    def _read_in_flight(self, then_keep: tuple[list[Sequence], DeviceDraw, str] | None = None) -> None:
        """Record the draws launched earlier (oldest first) and retire finished rows; `then_keep` stays in
        flight."""
        pending, self._in_flight = self._in_flight, [then_keep] if then_keep else []
        owed: dict[int, Sequence] = {}
        for rows, draw, phase in pending:
            start = time.perf_counter()
            steps = draw.read()
            waited = time.perf_counter()
            for token_ids, logprobs in steps:  # a row that ended at a step ignores the steps after it
                live = [
                    i for i, seq in enumerate(rows) if seq.finish_reason is None and not seq.request.cancelled
                ]
                if not live:
                    break
                owed |= self._record(
                    [rows[i] for i in live], [token_ids[i] for i in live], [logprobs[i] for i in live], None
                )
            self._busy_s[phase] += waited - start
            self._busy_s["host_s"] += time.perf_counter() - waited
        start = time.perf_counter()
        self._deliver_events(owed.values())
        self._busy_s["host_s"] += time.perf_counter() - start
        self._timed_retire()

    def _slot_sampling(self, rows: list[Sequence]) -> SlotSampling:
        return SlotSampling(
            temperature=[seq.request.params.temperature for seq in rows],
            top_p=[seq.request.params.top_p for seq in rows],
            top_k=[seq.request.params.top_k for seq in rows],
            seeds=[seq.seed for seq in rows],
            drawn=[len(seq.token_ids) for seq in rows],
            limits=[
                min(seq.request.max_new_tokens, self.max_model_len - len(seq.request.prompt_ids))
                for seq in rows
            ],
        )

    def _filters(self, rows: list[Sequence]) -> tuple[bool, bool]:
        return filters_needed(
            [seq.request.params.top_k for seq in rows],
            [seq.request.params.top_p for seq in rows],
            self.vocab_size,
        )

    def _step_on_host(self, admitted: list[tuple[Request, list[Sequence]]]) -> None:
        """Decode and/or prefill, drawing on the host's schedule: each step's tokens are read before the next
        step starts (grammars, blocked tokens and top logprobs need them; other batch kinds always do)."""
        self._rows_on_device = False
        if self._rows:
            start = time.perf_counter()
            logits = self._batch.decode([seq.pending for seq in self._rows])
            self._decode_steps["host"] += 1
            self._append(self._rows, logits, "decode_s", start)
        if admitted:
            start = time.perf_counter()
            logits, new_rows = self._prefill(admitted)
            self._append(new_rows, logits, "prefill_s", start)
            self._rows = self._rows + new_rows
        self._timed_retire()

    def _prefill(self, admitted: list[tuple[Request, list[Sequence]]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Admit the requests' prompts to the batch; their rows' first logits and the rows."""
        self._prefills += 1
        now = time.monotonic()
        for request, _ in admitted:
            request.admitted_at = request.admitted_at or now
        images = [request.images for request, _ in admitted]
        parts = [request.computed_in_parts for request, _ in admitted]
        logits = self._batch.admit(
            [request.prompt_ids for request, _ in admitted],
            [len(seqs) for _, seqs in admitted],
            reserve=max(len(r.prompt_ids) + r.max_new_tokens for r, _ in admitted),
            **({"images": images} if any(x is not None for x in images) else {}),
            **({"computed_in_parts": parts} if any(parts) else {}),
            **(
                {"hashes": [r.prompt_hashes for r, _ in admitted]}
                if isinstance(self._batch, SlotBatch)
                else {}
            ),
        )
        return logits, [seq for _, seqs in admitted for seq in seqs]

    def _append(self, rows: list[Sequence], logits: torch.Tensor, phase: str, start: float) -> None:
        """Sample one token per row on the host's schedule and record it.

        Time from `start` until the sampled ids reach the host (the device work) counts as `phase`; the
        per-row Python work before and after counts as host time."""
        host_start = time.perf_counter()
        settings = [
            RowSampling(
                temperature=s.request.params.temperature,
                top_p=s.request.params.top_p,
                top_k=s.request.params.top_k,
                seed=s.seed,
                position=len(s.token_ids),
                top_logprobs=s.request.top_logprobs,
                blocked_token_ids=self._blocked_below_min_tokens(s) + self._placeholder_ids,
            )
            for s in rows
        ]
        settings = self._constrain_rows(rows, settings)
        selected = time.perf_counter()
        step = select_tokens(logits, settings)
        synced = time.perf_counter()
        self._advance_matchers(rows, step.token_ids)
        self._deliver_events(self._record(rows, step.token_ids, step.logprobs, step.top_logprobs).values())
        self._busy_s[phase] += (host_start - start) + (synced - selected)
        self._busy_s["host_s"] += (selected - host_start) + (time.perf_counter() - synced)

    def _record(
        self,
        rows: list[Sequence],
        token_ids: list[int],
        logprobs: list[float],
        top_logprobs: list[dict[int, float] | None] | None,
    ) -> dict[int, Sequence]:
        """Append each row's drawn token and check stops; the rows that owe their request an event (finished, or
        streamed), by id, for `_deliver_events` once the caller has recorded every step it read."""
        owed: dict[int, Sequence] = {}
        now = time.monotonic()
        gaps: dict[float, int] = {}  # a previous token's time -> rows whose previous token came then
        for i, seq in enumerate(rows):
            request = seq.request
            if request.first_token_at is None:
                request.first_token_at = now
            if seq.last_token_at is not None:
                gaps[seq.last_token_at] = gaps.get(seq.last_token_at, 0) + 1
            seq.last_token_at = now
            seq.token_ids.append(token_ids[i])
            seq.logprobs.append(logprobs[i])
            if top_logprobs is not None and top_logprobs[i] is not None:
                seq.top_logprobs.append(top_logprobs[i])
            at_limit = len(seq.request.prompt_ids) + len(seq.token_ids) >= self.max_model_len
            self._detok.check_finished(seq, at_limit)
            if seq.finish_reason:
                request.finished_sequences += 1
                self._count_finished(seq.finish_reason, [seq], now)
                request.most_generated = max(request.most_generated, len(seq.token_ids))
                if request.finished_sequences == request.params.n:
                    self._metrics.finished_request(
                        request.arrived, request.admitted_at or now, request.first_token_at, now,
                        request.params.n, request.most_generated,
                    )  # fmt: skip
            if seq.finish_reason or seq.request.stream:
                owed[id(seq)] = seq
        if gaps:
            self._metrics.tokens_apart({now - then: count for then, count in gaps.items()})
        self._tokens_generated += len(rows)
        self._recent.append((now, len(rows)))
        while self._recent and self._recent[0][0] < now - 10.0:
            self._recent.popleft()
        return owed

    def _deliver_events(self, owed: Iterable[Sequence]) -> None:
        """Send each row its tokens since its last event (and its output if it finished): one event a row for
        all the decode steps of an engine step, as vLLM's multi-step scheduling streams them, so a streamed
        answer takes K times fewer chunks through the server and gateway, and the loop one wake-up."""
        events: dict[int, tuple[Request, list[StreamEvent]]] = {}
        for seq in owed:
            events.setdefault(id(seq.request), (seq.request, []))[1].append(self._detok.take_event(seq))
        self._deliver_all(list(events.values()))

    def _blocked_below_min_tokens(self, seq: Sequence) -> tuple[int, ...]:
        """Below `min_tokens`, EOS (unless ignored) and stop tokens cannot be drawn, as in vLLM."""
        if (
            len(seq.token_ids) >= seq.request.params.min_tokens or seq.matcher is not None
        ):  # a grammar ends it
            return ()
        return self._blocked_below_min_tokens_of(seq.request.params)

    def _blocked_below_min_tokens_of(self, params: SamplingParams) -> tuple[int, ...]:
        if params.min_tokens <= 0:
            return ()
        eos = () if params.ignore_eos else tuple(self._detok.eos_token_ids)
        return eos + tuple(params.stop_token_ids)

    # ----- constrained decoding (constraints.py) ----------------------------------------------
    def _attach_matchers(self, seqs: list[Sequence]) -> None:
        """Give each sequence of a constrained request its grammar matcher (ConstraintError if invalid)."""
        constraint = seqs[0].request.constraint if seqs else None
        if constraint is None:
            return
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self._detok.eos_token_ids)
        for seq, matcher in zip(seqs, self._grammars.start(constraint, len(seqs)), strict=True):
            seq.matcher = matcher

    def _constrain_rows(self, rows: list[Sequence], settings: list[RowSampling]) -> list[RowSampling]:
        """Each constrained row's allowed-token bitmask. No work before the first constrained request
        (`_grammars` is set before it is queued); after it, a scan of the rows (~5 us for 64)."""
        if self._grammars is None:
            return settings
        constrained = [i for i, seq in enumerate(rows) if seq.matcher is not None]
        if not constrained:
            return settings
        masks = fill_bitmasks([rows[i].matcher for i in constrained], self.vocab_size)
        settings = list(settings)
        for i, mask in zip(constrained, masks, strict=True):
            settings[i] = replace(settings[i], allowed=mask)
        return settings

    def _advance_matchers(self, rows: list[Sequence], token_ids: list[int]) -> None:
        """Feed each constrained row its drawn token; a completed grammar ends the row ("stop")."""
        if self._grammars is None:
            return
        for seq, token in zip(rows, token_ids, strict=True):
            if seq.matcher is not None:
                reason = advance(seq.matcher, token, self._grammars.eos_token_ids)
                if reason == "abort":
                    logger.error(
                        "constrained row drew token %d outside its grammar: %s",
                        token,
                        seq.matcher.get_error(),
                    )
                seq.finish_reason = reason

    def _timed_retire(self) -> None:
        """`_retire`, its seconds counted as host work: parking finished rows' slots and resetting them on the
        device are torch calls, each waiting to take the GIL back from a busy event loop (an H200 running the
        8-turn agent benchmark spent ~8 ms a retirement there, most of its engine thread's time)."""
        start = time.perf_counter()
        self._retire()
        self._busy_s["host_s"] += time.perf_counter() - start

    def _retire(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.finish_reason is None and not s.request.cancelled]
        self._sequences_finished += sum(s.finish_reason is not None for s in self._rows)
        if len(keep) != len(self._rows):
            left = [s for s in self._rows if s.finish_reason is None and s.request.cancelled]
            self._count_finished("abort", left)
            # A finished row's slot holds its prompt and every sampled token but the last (never fed).
            finished = {
                i: s.request.prompt_ids + s.token_ids[:-1]
                for i, s in enumerate(self._rows)
                if s.finish_reason is not None and not s.request.cancelled
            }
            self._batch.keep(keep, finished)
            self._rows = [self._rows[i] for i in keep]

    @staticmethod
    def _deliver_all(deliveries: list[tuple[Request, list[StreamEvent] | BaseException]]) -> None:
        """Hand each request its payload on its event loop: one wake-up per loop for a whole decode step, not
        one per request (each is a write to the loop's self-pipe and a turn of the loop)."""
        by_loop: dict[Any, list[tuple[Request, Any]]] = {}
        for request, payload in deliveries:
            by_loop.setdefault(request.loop, []).append((request, payload))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the callers' event loop is gone; nobody is waiting
                for request, _ in items:
                    request.cancelled = True

    def _count_finished(self, reason: str, rows: list[Sequence], now: float | None = None) -> None:
        """Count completions that ended, at `now` (default: now), for `reason`: their own finish reason, "abort"
        (their client left) or "error" (a step failed under them)."""
        now = time.monotonic() if now is None else now
        for seq in rows:
            request = seq.request
            self._metrics.finished_completion(
                reason, len(request.prompt_ids), len(seq.token_ids), request.first_token_at, now,
                request.params.max_tokens,
            )  # fmt: skip

    def _fail_running(self, error: BaseException) -> None:
        self._count_finished("error", [s for s in self._rows if s.finish_reason is None])
        failed = {id(s.request): s.request for s in self._rows}
        with self._cond:
            if self._closed:
                failed.update({id(r): r for r, _ in self._waiting})
                self._waiting.clear()
        self._deliver_all([(request, error) for request in failed.values()])
        self._rows, self._in_flight, self._rows_on_device = [], [], False
        self._batch.clear()

    def decode(self, token_ids: list[int]) -> str:
        """Completion text of `token_ids` as `generate` reports it (control tokens dropped)."""
        return self._detok.decode(token_ids)

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the step lock for an admin operation; the scheduler yields it at the next step boundary.

        Without the hand-off the scheduler thread would re-take the (unfair) lock after every step
        and a weight update would wait until the engine went idle.
        """
        with self._cond:
            self._admin_waiting += 1
        try:
            with self._step_lock:
                yield
        finally:
            with self._cond:
                self._admin_waiting -= 1
                self._cond.notify_all()

    # ----- weights, adapters, memory ----------------------------------------------------------
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full weights (a mapping, or (name, tensor) pairs streamed in) in place between two decode
        steps; returns the new policy version."""
        with self._between_steps():
            names: set[str] = set(weights) if isinstance(weights, Mapping) else set()
            if not isinstance(weights, Mapping):
                weights = _recording_names(weights, names)
            load_weights_in_place(self.model, weights)
            self._batch.weights_changed()
            self._batch.forget_prefixes(self.prefix_max_weight_changes)
            self._lora.forget_base()
            self.policy_version += 1
            if self._parked.discarded:  # woken from a `discard_weights` sleep: generate once all are loaded
                self._parked.loaded(names)
                self._resume()
            return self.policy_version

    def load_lora_adapter(self, name: str, path: str) -> int:
        """Merge the peft adapter folder `path` into the served weights (replacing any earlier adapter).

        Merged, not served through peft: decoding stays as fast as the base model, and one adapter
        is active at a time (what RL needs: the latest adapter). Returns the new policy version.
        """
        with self._between_steps():
            self._lora.merge(self.model, name, path)
            self._batch.weights_changed()
            self._batch.forget_prefixes(self.prefix_max_weight_changes)
            self.policy_version += 1
            return self.policy_version

    @property
    def lora_adapter(self) -> str | None:
        """Name of the merged adapter, if any."""
        return self._lora.active

    def mark_weights_updated(self) -> int:
        """The trainer changed the shared weights in place: serve them as a new policy version.

        The module comes back from training in train mode, where prefill would checkpoint (and so keep no
        cache) and apply dropout: the engine puts it back in eval mode."""
        with self._between_steps():
            self.model.eval()
            self._batch.weights_changed()
            self._batch.forget_prefixes(self.prefix_max_weight_changes)
            self.policy_version += 1
            return self.policy_version

    def weights_fingerprint(self) -> str:
        """`fingerprint_state_dict` of the served weights; equals the trainer's for the same weights. Where the
        steps' fused projection copies no longer equal the modules (a weight written in place with no
        `mark_weights_updated`), it names them instead, so no trainer's fingerprint matches: the module's hash
        alone would vouch for weights the steps do not multiply by."""
        with self._between_steps():
            fused = getattr(self._batch, "fused", None)
            stale = fused.stale_layers() if fused is not None and not self._asleep else []
            if stale:
                logger.error(
                    "embedded engine: the fused projection weights of layers %s differ from the model's own: its "
                    "weights were written without update_weights or mark_weights_updated",
                    stale,
                )
                return f"stale-fused-projections(layers {stale[:8]})"
            return fingerprint_state_dict(self.model.state_dict())

    def sleep(self, discard_weights: bool = False, keep_allocator_cache: bool = False) -> None:
        """Free generation memory (KV cache; on CUDA also move weights it owns to CPU). Needs no running rows.
        Under CUDA graphs the cache keeps its addresses (`SlotBatch.release_cache`), weights it owns come back
        to theirs (`ParkedWeights`), and the graphs stay: only their own working memory is held while the
        engine sleeps. `discard_weights`: the caller pushes every weight after the wake (the synchronous
        step's sync), so weights it owns are neither copied out nor back (vLLM's sleep level 2); the engine
        generates again once that push has loaded them all.

        `keep_allocator_cache`: the memory PyTorch's allocator caches stays with this process, for a trainer
        in it that no other process shares the device with. That trainer reuses the cached blocks (the
        allocator returns them to the driver itself before it reports out of memory, and so does the cache's
        restore at the wake); emptying the cache at every sleep made each update allocate afresh: ~490
        cudaMalloc/cudaFree pairs and 66 ms of host time a SmolLM2 update on an H200. Otherwise the cache is
        emptied, so another process (a critic sharing the GPU, any process after `agentrl serve`'s /sleep)
        can use the memory."""
        with self._between_steps():
            if self._rows:
                raise RuntimeError(f"cannot sleep: {len(self._rows)} sequences are running")
            with self._cond:
                self._asleep = True
            self._batch.release_cache()
            if self._device.type == "cuda":
                if self.owns_weights:
                    self._parked.park(keep=not discard_weights)
                if not keep_allocator_cache:
                    torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Undo `sleep`; requests that arrived meanwhile start now (after a `discard_weights` sleep, once a push
        has loaded every weight: `update_weights`). The calling thread (a hybrid trainer's, which now waits for
        the rollouts) gives its OpenMP workers back, so that the engine's thread has the cores (`_openmp.py`)."""
        release_openmp_workers()
        with self._between_steps():
            if self._device.type == "cuda" and self.owns_weights:
                self._parked.restore()
            self._batch.weights_changed()  # graphs kept across the sleep read the weights where they were
            if not self._parked.discarded:
                self._resume()

    def _resume(self) -> None:
        with self._cond:
            self._asleep = False
            self._cond.notify()

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    def stats(self) -> dict[str, Any]:
        """Running/waiting sequences, tokens generated, recent throughput (tokens/s over 10 s)."""
        with self._cond:
            waiting = sum(len(seqs) for _, seqs in self._waiting)
        recent = list(self._recent)
        span = (recent[-1][0] - recent[0][0]) if len(recent) > 1 else 0.0
        throughput = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return {
            "running": len(self._rows),
            "waiting": waiting,
            "tokens_generated": self._tokens_generated,
            "sequences_finished": self._sequences_finished,
            "prefills": self._prefills,
            **{f"decode_steps_{where}": count for where, count in self._decode_steps.items()},
            **{f"busy_{name}": round(value, 4) for name, value in self._busy_s.items()},
            **{
                f"busy_{name}": round(value, 4) for name, value in getattr(self._batch, "setup_s", {}).items()
            },
            "throughput_tokens_per_s": round(throughput, 2),
            **self._cache_stats(),
            "kv_slots": self._batch.slots,
            "sleeping": self._asleep,
            "policy_version": self.policy_version,
            "lora_adapter": self._lora.active,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.enable_prefix_caching,
            "compile_decode": isinstance(self._batch, SlotBatch) and self._batch.compiled,
            "enable_chunked_prefill": self.chunked_prefill,
            "max_num_batched_tokens": self.prefill_chunk_tokens,
            "num_scheduler_steps": self.num_scheduler_steps,
            "request_metrics": self._metrics.snapshot(),
        }

    def _cache_stats(self) -> dict[str, Any]:
        """Prompt tokens admitted and found in the prefix cache, prefill work, and how full the KV cache is."""
        if isinstance(self._batch, SlotBatch):
            self._batch.settle_timings()
        counters = dict(self._batch.counters)
        stats = {
            "prompt_tokens": counters["prompt_tokens"],
            "prefix_cache_queries": counters["prompt_tokens"],
            "prefix_cache_hits": counters["prefix_hit_tokens"],
            "prefill_tokens": counters["prefill_tokens"],
            "prefill_forwards": counters["prefill_forwards"],
            "rows_compacted": counters.get("compacted_rows", 0),
            "prefill_parts": counters.get("prefill_parts", 0),
            "prefill_shared_prefix_forwards": counters.get("shared_prefix_prefills", 0),
            "decode_shared_prefix_steps": counters.get("shared_prefix_decodes", 0),
            "busy_prefill_forward_s": round(counters["prefill_s"], 4),
            **{
                (f"busy_prefill_{key}" if key.endswith("_s") else f"prefill_{key}"): round(counters[key], 4)
                for path in PREFILL_PATHS
                for key in (f"{path}_forwards", f"{path}_tokens", f"{path}_s", f"{path}_host_s")
                if key in counters
            },
            "kv_cache_usage": 0.0,
            "parked_sequences": 0,
            "kv_cache_gib": 0.0,
            "fused_projections_gib": 0.0,
        }
        fused = getattr(self._batch, "fused", None)
        if fused is not None and not self._asleep:
            stats["fused_projections_gib"] = round(fused.nbytes / 2**30, 4)
        if isinstance(self._batch, SlotBatch) and self._batch.length:
            capacity = self._batch.max_slots * self._batch.length
            stats["kv_cache_usage"] = round(self._batch.held_tokens / capacity, 4)
            stats["parked_sequences"] = len(self._batch.prefixes)
            stats["kv_cache_gib"] = round(self._batch.cache_bytes / 2**30, 4)
        return stats

    def close(self) -> None:
        """Stop the scheduler thread; waiting and running requests fail with RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)


def _put_all(items: list[tuple[Request, Any]]) -> None:
    for request, payload in items:
        request.queue.put_nowait(payload)


def build_embedded_engine(
    model_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    **options: Any,
) -> EmbeddedEngine:
    """Load model and tokenizer (HF id, folder or `tiny:` preset) and wrap them in an engine; `options` are
    `EmbeddedEngine`'s other keyword arguments."""
    from agentrl.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(model_path, dtype=dtype, device=device)
    return EmbeddedEngine(
        model, load_tokenizer(model_path), max_num_seqs=max_num_seqs, max_model_len=max_model_len, **options
    )

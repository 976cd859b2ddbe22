"""The slot batch's steps through torch.compile: the decode step, the extend step and the FlashAttention extend
step, each made once per process and backend, with the sizes that vary marked symbolic.

Each decoder layer is compiled once and its graph serves every layer (the weights are graph inputs), and the
layers' parts that read the cache run as they are between compiled parts where tracing them went wrong
(`_split_extend_layer`). `SlotBatch` picks these under CUDA graphs (and the decode step on the CPU) when
`compile_decode` is on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from agentrl.rollout.engines._flash_extend import flash_extend_inputs, flash_extend_step, flash_layer
from agentrl.rollout.engines._slot_decode import (
    DecodeRegions,
    cache_attention,
    decode_inputs,
    decode_step,
    extend_inputs,
    extend_step,
    layer_output,
    layer_projections,
    slot_layer,
)
from agentrl.rollout.engines.shared_prefix_attention import SharedPrefixMask

_COMPILED: dict[Any, Callable[..., Any]] = {}
"""(what, backend) -> a compiled function, made once per process: each step and each step's layer."""


def _compiled(what: str, backend: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    if (what, backend) not in _COMPILED:
        _COMPILED[what, backend] = make()
    return _COMPILED[what, backend]


INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 1}
"""Inductor settings of every step compiled here. `cpp.min_chunk_size` 1: the C++ backend runs each loop nest on
every thread; by default (512) one whose size hint divided by the threads is below 512 elements runs on one thread
while the others wait. The hints are the sizes of the first trace, which `SlotBatch.compile_now` makes on small
placeholders (the shared-prefix plans' 16 and 32 positions): the softmax over a shared prefix ran on one thread
of two for every step after (`benchmarks/decode_layer_hints.py`, 2 cores: a 32-row layer 1.404 ms against 1.254
with this setting and 1.236 traced on real sizes). Nothing changes on CUDA (Triton's kernels)."""


def compile_step_part(function: Callable[..., Any], backend: Any) -> Callable[..., Any]:
    """torch.compile of a step's part with `INDUCTOR_OPTIONS` under Inductor (other backends take none)."""
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    return torch.compile(function, backend=backend, options=options)


def _rows_marked_inputs(inputs: Callable[..., tuple], backend: Any) -> Callable[..., tuple]:
    """A step's inputs function (`decode_inputs`, `extend_inputs`) through torch.compile, its rows marked
    symbolic on every call."""
    from torch._dynamo import maybe_mark_dynamic

    compiled = compile_step_part(inputs, backend)

    def rows_marked_inputs(model, token_ids, positions, rope_offsets, length):
        for tensor in (token_ids, positions, rope_offsets):
            if tensor is not None:
                maybe_mark_dynamic(tensor, 0)
        return compiled(model, token_ids, positions, rope_offsets, length)

    return rows_marked_inputs


def mark_layer_sizes(layer: Callable[..., Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The compiled decode layer `layer` with the sizes that vary marked symbolic on every call: the rows (dim 0
    of every per-row input), the cache positions read (the mask's last dim, the cache's length) and a shared
    prefix's plan (its groups, their most members, the step's slots)."""
    from torch._dynamo import maybe_mark_dynamic

    def rows_and_length_marked_layer(
        module, following, hidden, x, cos, sin, keys, values, positions, visible, *rest
    ):
        mask = visible.mask if isinstance(visible, SharedPrefixMask) else visible
        for tensor in (hidden, x, cos, sin, positions, mask):
            maybe_mark_dynamic(tensor, 0)
        maybe_mark_dynamic(mask, 3)  # the cache positions read
        if isinstance(visible, SharedPrefixMask):  # the groups, their most members, the step's slots
            plan = visible.prefix
            for tensor, dims in ((plan.members, (0, 1)), (plan.leaders, (0,)), (plan.member_of_slot, (0,))):
                for dim in dims:
                    maybe_mark_dynamic(tensor, dim)
        maybe_mark_dynamic(keys, 2)
        maybe_mark_dynamic(values, 2)
        return layer(module, following, hidden, x, cos, sin, keys, values, positions, visible, *rest)

    return rows_and_length_marked_layer


def _marked_layer(backend: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`slot_layer` through torch.compile for the decode step, its varying sizes marked (`mark_layer_sizes`)."""
    return _compiled("layer", backend, lambda: mark_layer_sizes(compile_step_part(slot_layer, backend)))


def _split_extend_layer(backend: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`slot_layer` for the extend step: its projections and its output part compiled (the rows symbolic), the
    cache's part (`cache_attention`) run as it is between them (`compiled_flash_extend_step` shares the compiled
    parts). Compiled whole like the decode step's layer, the graph took the cache and the span read as one size
    where they had been equal when it was traced, and failed Inductor's input check on an H200 once they
    differed; outside the graphs the cache's size never matters."""

    def make() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        from torch._dynamo import maybe_mark_dynamic

        projections = _compiled("projections", backend, lambda: compile_step_part(layer_projections, backend))
        output = _compiled("layer output", backend, lambda: compile_step_part(layer_output, backend))

        def split_layer(
            module, following, hidden, x, cos, sin, keys, values, positions, visible, head_dim, fused, slots
        ):
            for tensor in (hidden, x, cos, sin):
                maybe_mark_dynamic(tensor, 0)
            q, k, v = projections(module, x, cos, sin, head_dim, fused)
            scale = module.self_attn.scaling
            out = cache_attention(q, k, v, keys, values, positions, visible, scale, slots)
            maybe_mark_dynamic(out, 0)
            return output(module, following, hidden, out, fused)

        return split_layer

    return _compiled("extend layer", backend, make)


def compiled_decode_step(backend: Any = "inductor") -> Callable[..., torch.Tensor]:
    """`decode_step` with its inputs and each decoder layer run through torch.compile, once per process and
    backend. One layer is traced and its graph serves every layer (same code; the weights are graph inputs): the
    whole step traced as one graph took 33-81 s at every start of a 24-layer model. Only the rows and the cache
    length are symbolic (marked on every call); widths, heads and head size stay static. With every size
    symbolic, Dynamo's symbolic reasoning was most of the compile and no cache keeps it: on an H200 the compile
    took 13.4 s with Inductor's cache warm and 19.1 s cold, against 2.6 and 9.7 s this way, decode steps no
    slower (`benchmarks/decode_compile.py`); a GRPO run's first step came 18.9 s after the start of a warm step
    instead of 38.6 s. The cache length reaches the inputs as an int, which compiles once more when it first
    changes (`SlotBatch.compile_now` does that before any request). The marks are `maybe_mark_dynamic`: a size
    the code turns into a constant costs a compile per value instead of failing the compile (a hard mark did,
    and the engine fell back to the plain step)."""

    def make() -> Callable[..., torch.Tensor]:
        regions = DecodeRegions(_rows_marked_inputs(decode_inputs, backend), _marked_layer(backend))
        return functools.partial(decode_step, regions=regions)

    return _compiled("decode", backend, make)


def compiled_extend_step(backend: Any = "inductor") -> Callable[..., torch.Tensor]:
    """`extend_step` with its inputs and the parts of each decoder layer around the cache compiled
    (`_split_extend_layer`): Inductor fuses the ~880 small kernels (norms, rotary, residuals, casts) that made two
    fifths of an extend graph's replay at the agent step's shapes (docs/benchmarks.md). The rows and the cache
    span are symbolic; the width is not, so the engine pads every compiled extend to `EXTEND_MAX_TOKENS` (next
    turns are ~50 tokens: little is padded that was not before) rather than compile once per width."""

    def make() -> Callable[..., torch.Tensor]:
        regions = DecodeRegions(_rows_marked_inputs(extend_inputs, backend), _split_extend_layer(backend))
        return functools.partial(extend_step, regions=regions)

    return _compiled("extend", backend, make)


def _rows_marked(compiled: Callable[..., Any], marked: tuple[int, ...]) -> Callable[..., Any]:
    """`compiled` with dim 0 of its arguments at `marked` made symbolic on every call (`maybe_mark_dynamic`)."""
    from torch._dynamo import maybe_mark_dynamic

    def rows_marked(*args: Any) -> Any:
        for index in marked:
            maybe_mark_dynamic(args[index], 0)
        return compiled(*args)

    return rows_marked


def compiled_flash_extend_step(backend: Any = "inductor") -> Callable[..., torch.Tensor]:
    """`flash_extend_step` with its inputs and each layer's parts around the cache compiled: the projections and
    output part `compiled_extend_step` compiles (its packed tokens are rows of `EXTEND_MAX_TOKENS`), the rows
    symbolic. Where `rotary_write` serves the layer, its kernel replaces the compiled projections' rotary."""

    def make() -> Callable[..., torch.Tensor]:
        projections = _compiled("projections", backend, lambda: compile_step_part(layer_projections, backend))
        output = _compiled("layer output", backend, lambda: compile_step_part(layer_output, backend))
        layer = functools.partial(
            flash_layer, projections=_rows_marked(projections, (1, 2, 3)), output=_rows_marked(output, (2, 3))
        )
        regions = DecodeRegions(_rows_marked_inputs(flash_extend_inputs, backend), layer)
        return functools.partial(flash_extend_step, regions=regions)

    return _compiled("flash extend", backend, make)

"""Each decoder layer's parallel projections as one matrix each: queries, keys and values, and the MLP's gate and up.

A layer multiplies its input by q, k and v (three weights) and its normed residual by gate and up (two): five
launches where two do the same work, and each small multiply leaves an H200 idler than one wider one. Measured
on an H200 with the 0.5B shape: a 12-row next-turn prefill forward (576 tokens) 1.98 against 2.13 ms when q/k/v
were concatenated inside every forward (270 against 318 kernels), the 8-turn agent step's decode 1.13x the tokens/s
(docs/benchmarks.md). vLLM loads its weights into merged parameters; the embedded engine serves the model as
transformers builds it (the trainer's own module under the hybrid engine), so it keeps concatenated copies here
and copies the weights into them again whenever they change (`SlotBatch.weights_changed`: a push, a LoRA merge,
the trainer's step on shared weights, a wake). They cost the memory of those weights once more (two thirds of
the layers' weights: 0.4 GiB for the 0.5B shape in bfloat16), given back while the engine sleeps
(`actor_rollout_ref.rollout.fuse_projections=false` keeps none).

Under CUDA graphs the copies lie in `StableMemory`, so the graphs that read them survive the sleep as the
cache's do.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from agentrl.rollout.engines._stable_memory import StableMemory, stable_memory

ALIGNMENT = 512
"""Bytes each copy's place is aligned to (what kernels assume of a fresh allocation)."""
DOWN_SPLITS = 2
"""Parts of the inner dimension the MLP's down projection is split into on CUDA (`split_inner_linear`)."""


class LayerFused(NamedTuple):
    """One layer's concatenated weights, what its projections read in place of the modules'."""

    qkv: torch.Tensor
    """(q + k + v outputs, hidden): q_proj's, k_proj's and v_proj's weights one under the other."""
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    """(2 x intermediate, hidden): gate_proj's weight over up_proj's."""
    widths: tuple[int, int, int]
    """Outputs of q, k and v: where `qkv`'s product splits."""
    down_splits: int = 1
    """Parts the down projection's inner dimension is split into (`split_inner_linear`); 1: one multiply."""


def project_qkv(
    attn: torch.nn.Module, x: torch.Tensor, fused: LayerFused | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of `x` (..., hidden), each (..., its outputs): one multiply with `fused`."""
    if fused is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q, k, v = F.linear(x, fused.qkv, fused.qkv_bias).split(fused.widths, dim=-1)
    return q, k, v


def mlp_output(mlp: torch.nn.Module, x: torch.Tensor, fused: LayerFused | None) -> torch.Tensor:
    """The MLP of `x`: down(act(gate(x)) x up(x)), gate and up as one multiply with `fused`."""
    if fused is None:
        return mlp(x)
    gate, up = F.linear(x, fused.gate_up).chunk(2, dim=-1)
    hidden = mlp.act_fn(gate) * up
    if fused.down_splits == 1:
        return mlp.down_proj(hidden)
    return split_inner_linear(hidden, mlp.down_proj.weight, fused.down_splits)


def split_inner_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) as `splits` products over consecutive parts of the inner dimension, one
    batched multiply over views (no copy); each part comes out in `x`'s dtype and they are summed in float32 (in
    bfloat16 the result is 1-2 rounding steps from the one product's, which rounds once).

    The down projection has few outputs (the hidden size) and a long inner dimension (the MLP's): for a prefill of
    a few hundred tokens cuBLAS tiles its output into about one tile per streaming multiprocessor and walks 4,864
    inputs in each, and the product ran at 320 TFLOP/s for 576 tokens where it ran at 545 for 768. Two halves
    give the GPU twice the tiles; under Inductor the sum joins the residual add's kernel. On an H200, the 0.5B
    shape's layer part after attention took 46.1 against 51.9 us for 576 tokens, 37.2 against 43.3 for 448 and
    62.0 against 66.8 for 1,024 (docs/benchmarks.md)."""
    rows = x.reshape(-1, x.shape[-1])
    outputs, inputs = weight.shape
    part = inputs // splits
    products = torch.bmm(
        rows.view(-1, splits, part).transpose(0, 1), weight.view(outputs, splits, part).permute(1, 2, 0)
    )
    total = products.sum(0, dtype=torch.promote_types(x.dtype, torch.float32))
    return total.to(x.dtype).view(*x.shape[:-1], outputs)


def down_splits_for(mlp: torch.nn.Module) -> int:
    """`DOWN_SPLITS` for a bias-free down projection on CUDA whose parts stay 16-byte aligned, else 1 (on the CPU
    the one multiply is the faster)."""
    down = mlp.down_proj
    aligned = down.in_features % (DOWN_SPLITS * 8) == 0
    return DOWN_SPLITS if down.weight.is_cuda and down.bias is None and aligned else 1


def _plain(module: object) -> bool:
    return type(module) is torch.nn.Linear


def unfusable_reason(layers: Sequence[torch.nn.Module]) -> str | None:
    """Why the layers' projections cannot be fused (None: they can): every layer needs plain `nn.Linear` q, k, v
    (biases on all three or none), gate and up (no biases) of one dtype, and an MLP of `down_proj(act_fn(gate) x
    up)`. Adapter-wrapped, quantized or already merged projections (Phi-3's `gate_up_proj`) keep their modules."""
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
        if not all(_plain(linear) for linear in linears) or not hasattr(mlp, "act_fn"):
            return f"layer {index}'s projections are not plain nn.Linear q/k/v and gate/up"
        if not _plain(getattr(mlp, "down_proj", None)):
            return f"layer {index}'s MLP has no plain down_proj"
        if len({linear.bias is None for linear in linears[:3]}) > 1 or any(
            m.bias is not None for m in linears[3:]
        ):
            return f"layer {index} has biases on some of q/k/v only, or on gate/up"
        if len({linear.weight.dtype for linear in linears}) > 1:
            return f"layer {index}'s projections differ in dtype"
    return None


class FusedProjections:
    """Concatenated copies of every layer's q/k/v and gate/up weights (`layers[i]` for layer i), in one block of
    device memory: `StableMemory` under CUDA graphs where the driver offers it (`stable`), else the allocator's."""

    def __init__(self, layers: Sequence[torch.nn.Module], stable: bool) -> None:
        self._layers = list(layers)
        """The decoder layers, whose projections are looked up at every `refresh` (a LoRA merge wraps and unwraps
        them)."""
        self._shapes, end = [], 0
        for attention, mlp in map(_sources, self._layers):
            places = []
            for rows, columns in (
                (sum(m.out_features for m in attention), attention[0].in_features),
                (sum(m.out_features for m in mlp), mlp[0].in_features),
            ):
                places.append((end, (rows, columns)))
                end = _aligned(end + rows * columns * self.dtype.itemsize)
            if attention[0].bias is not None:
                places.append((end, (sum(m.out_features for m in attention),)))
                end = _aligned(end + places[-1][1][0] * self.dtype.itemsize)
            self._shapes.append(places)
        self.nbytes = end
        self.device = self._layers[0].self_attn.q_proj.weight.device
        self._memory: StableMemory | None = (
            stable_memory(self.nbytes, self.device, "the fused projection weights") if stable else None
        )
        self.stable = self._memory is not None
        self.layers: list[LayerFused] = []
        self.refresh()

    @classmethod
    def of(cls, layers: Sequence[torch.nn.Module], stable: bool) -> FusedProjections | None:
        """Fused copies of the decoder `layers`, or None where `unfusable_reason` finds one they cannot serve."""
        return None if unfusable_reason(layers) else cls(layers, stable)

    @property
    def dtype(self) -> torch.dtype:
        return self._layers[0].self_attn.q_proj.weight.dtype

    def refresh(self) -> None:
        """Copy the modules' current weights in (after a sleep, into memory mapped again or allocated anew)."""
        if self._memory is not None:
            self._memory.restore()  # nothing to do unless released
        if not self.layers:
            self.layers = self._place()
        self._on_device(self._copy)

    def _copy(self) -> None:
        with torch.no_grad():
            for (attention, mlp), fused in zip(map(_sources, self._layers), self.layers, strict=True):
                torch.cat([m.weight for m in attention], out=fused.qkv)
                torch.cat([m.weight for m in mlp], out=fused.gate_up)
                if fused.qkv_bias is not None:
                    torch.cat([m.bias for m in attention], out=fused.qkv_bias)

    def stale_layers(self) -> list[int]:
        """Layers whose copies differ from their modules' weights now: none unless a weight was written without
        `refresh` after it (what the engine's fingerprint check looks for: the fingerprint reads the modules)."""
        stale: list[int] = []

        def compare() -> None:
            with torch.no_grad():
                for index, (layer, fused) in enumerate(zip(self._layers, self.layers, strict=True)):
                    attention, mlp = _sources(layer)
                    pairs = [(attention, "weight", fused.qkv), (mlp, "weight", fused.gate_up)]
                    if fused.qkv_bias is not None:
                        pairs.append((attention, "bias", fused.qkv_bias))
                    if not all(
                        torch.equal(torch.cat([getattr(m, n) for m in ms]), kept) for ms, n, kept in pairs
                    ):
                        stale.append(index)

        if self.layers:  # else released: no copies to differ
            self._on_device(compare)
        return stale

    def _on_device(self, work: Callable[[], None]) -> None:
        """`work` on the copies; on the CPU in a thread that ends with it (`in_passing_thread`)."""
        if self.device.type == "cpu":
            in_passing_thread(work)
        else:
            work()

    def release(self) -> None:
        """Give the copies' memory back while the engine sleeps; `refresh` brings them back. Stable memory keeps
        its addresses (and `layers` over them), so graphs that read it stay valid; other memory is freed and
        comes back elsewhere (the caller drops its graphs)."""
        if self._memory is not None:
            self._memory.release()
        else:
            self.layers = []

    def _place(self) -> list[LayerFused]:
        if self._memory is not None:
            block = self._memory.tensor(0, self.nbytes)
        else:
            block = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        itemsize = self.dtype.itemsize
        layers = []
        for layer, places in zip(self._layers, self._shapes, strict=True):
            attention, _ = _sources(layer)
            qkv, gate_up, *bias = (
                block[at : at + math.prod(shape) * itemsize].view(self.dtype).view(shape)
                for at, shape in places
            )
            widths = tuple(m.out_features for m in attention)
            splits = down_splits_for(layer.mlp)
            layers.append(LayerFused(qkv, bias[0] if bias else None, gate_up, widths, splits))
        return layers


def in_passing_thread(work: Callable[[], None]) -> None:
    """Run `work` (torch operations on the CPU) in a thread that ends with it, and re-raise what it raised.

    PyTorch's CPU operations run on OpenMP (libgomp), which gives every thread that starts a parallel operation a
    team of worker threads for as long as that thread lives. One team left in the thread that built the engine
    (the fused copies' first copy, ~2 MB) made more OpenMP threads than cores on a 2-core host, and libgomp then
    lets its waiting threads sleep almost at once: every one of the engine thread's small parallel operations paid
    for waking its worker. `agentrl serve` answered 0.60x vLLM's requests/s where it had answered 0.9x, its decode
    steps twice as long (docs/benchmarks.md). A thread that ends takes its team with it."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as failure:  # noqa: BLE001 (re-raised in the caller's thread)
            failures.append(failure)

    thread = threading.Thread(target=run, name="agentrl-cpu-copy")
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


def _sources(layer: torch.nn.Module) -> tuple[tuple[torch.nn.Linear, ...], tuple[torch.nn.Linear, ...]]:
    """A layer's (q, k, v) and (gate, up) projections."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT

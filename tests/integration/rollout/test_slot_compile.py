"""`SlotBatch.compile_now` and the layer-wise compiled decode step: one decoder layer is traced, before the first
request, with inputs like the ones decoding passes (the rows and the cache length marked symbolic, at two cache
lengths), and that one graph serves every layer and every later decode
(a whole-step trace took ~45 s at every start of a 24-layer model; a second compile inside the first rollout
cost ~60-80 s more on an H100 host)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from agentrl.rollout.engines._compiled_steps import (
    compile_step_part,
    compiled_decode_step,
    compiled_extend_step,
)
from agentrl.rollout.engines._prefix_cache import block_hashes
from agentrl.rollout.engines._slot_batch import EXTEND_MAX_TOKENS, SlotBatch
from agentrl.rollout.engines._slot_decode import decode_step, extend_step, text_model


def _recording_backend() -> tuple[list[torch.fx.GraphModule], Callable]:
    """Dynamo reset, and a backend that keeps each graph it is given (tracing and guards, no code generation)."""
    torch._dynamo.reset()
    counters.clear()
    graphs: list[torch.fx.GraphModule] = []

    def recording(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return graph.forward

    return graphs, recording


def test_one_traced_layer_serves_every_layer_and_nothing_compiles_again(model):
    """A recording backend stands in for Inductor (Dynamo's tracing and guards, no code generation): the step's
    inputs (twice: the CPU step reads a span of the cache, which compile_now's second span makes symbolic) and
    one layer (one attention) are traced at `compile_now`, and never again, for a longer cache, a longer span
    and another bucket; the logits equal the plain step's."""
    graphs, recording = _recording_backend()
    batch = SlotBatch(model, max_slots=16, max_model_len=1024, cuda_graphs=False)
    batch._decode_step = compiled_decode_step(backend=recording)
    assert batch.compile_now() > 0
    assert batch.length == 0  # the cache it traced with is freed again
    # the inputs twice, the layer reading each row's own copy, the layer reading a shared prefix three times
    assert len(graphs) == 6
    nodes = [node for graph in graphs for node in graph.graph.nodes]
    # One attention (SDPA, or on the CPU the softmax of `decode_attention`): one layer, not the whole step.
    attentions = [
        n for n in nodes if any(op in str(n.target) for op in ("scaled_dot_product_attention", "softmax"))
    ]
    assert len(attentions) == 1 < len(text_model(model).layers)
    prompts = [[5, 6, 7, 8], [9, 10]]
    batch.admit(prompts, [3, 2], reserve=300)  # a 512-position cache, 5 rows: bucket 8
    for _ in range(3):
        batch.decode([11] * batch.size)
    batch.admit([[12, 13, 14]], [6], reserve=300)  # 11 rows: bucket 16
    batch.decode([15] * batch.size)
    batch.admit([list(range(20, 220))], [1], reserve=300)  # a 192-position span
    batch.decode([16] * batch.size)
    assert len(graphs) == 6
    assert counters["stats"]["unique_graphs"] == 6

    # The same step again through the plain function: it rewrites the same keys and values, so the logits compare.
    bucket = batch._bucket(batch.size)
    compiled_logits = batch._step(bucket)
    batch._decode_step = decode_step
    torch.testing.assert_close(compiled_logits, batch._step(bucket))


def test_the_compiled_step_reads_a_shared_prefix_once_and_no_plan_compiles_it_again(model):
    """On the CPU in float32 the compiled decode step reads a prompt prefix its rows share once a group, as the
    plain step does (`shared_prefix_attention.py`): `compile_now` traces it on placeholder plans, and then real
    plans of one to four groups, two to eight rows each, over prefixes of 64 to 320 tokens trace nothing new;
    each step's logits equal the plain step's."""
    graphs, recording = _recording_backend()
    batch = SlotBatch(model, max_slots=32, max_model_len=1024, cuda_graphs=False)
    batch._decode_step = compiled_decode_step(backend=recording)
    batch.compile_now()
    traced = len(graphs)
    generator = torch.Generator().manual_seed(1)
    for groups, rows_each, shared in ((1, 2, 64), (2, 5, 144), (4, 3, 320), (3, 8, 96), (1, 6, 208)):
        batch.keep([])
        prompts = []
        for _ in range(groups):
            prefix = torch.randint(10, 1000, (shared,), generator=generator).tolist()
            prompts += [
                prefix + torch.randint(10, 1000, (7,), generator=generator).tolist() for _ in range(rows_each)
            ]
        batch.admit(prompts, [1] * len(prompts), reserve=300, hashes=[block_hashes(p) for p in prompts])
        for _ in range(2):
            batch.decode([11] * batch.size)
        plan = batch._shared[1] if batch._shared is not None else None
        assert plan is not None and plan.length == shared and plan.members.shape[0] == groups
        bucket = batch._bucket(batch.size)
        compiled_logits = batch._step(bucket)
        batch._decode_step = decode_step
        torch.testing.assert_close(compiled_logits, batch._step(bucket))
        batch._decode_step = compiled_decode_step(backend=recording)
    assert len(graphs) == traced, f"{len(graphs) - traced} more graphs traced after compile_now"


def test_an_engine_of_fewer_slots_than_the_placeholders_compiles_once_and_reads_every_rows_copy(
    model, caplog
):
    """Four slots hold no placeholder plan: `compile_now` compiles the plain layer only (no warning, no fall
    back to the plain step), and rows sharing a prefix then decode through it, each over its own copy."""
    graphs, recording = _recording_backend()
    batch = SlotBatch(model, max_slots=4, max_model_len=512, cuda_graphs=False)
    batch._decode_step = compiled_decode_step(backend=recording)
    with caplog.at_level("WARNING", logger="agentrl.rollout.engines._slot_batch"):
        batch.compile_now()
    assert not caplog.records and batch._decode_step is not decode_step
    traced = len(graphs)
    prompt = list(range(10, 110))
    batch.admit([prompt], [3], reserve=200, hashes=[block_hashes(prompt)])
    batch.decode([11] * batch.size)
    assert batch.counters["shared_prefix_decodes"] == 0 and len(graphs) == traced


def test_the_extend_step_compiles_at_compile_now_and_no_later_shape_compiles_again(model):
    """The extend step (an agent's next turn over its cached history, under CUDA graphs) is compiled around the
    cache (no graph reads or writes it): `compile_now` traces it, and then extends of other row counts, spans and
    cache lengths trace nothing new; the logits and the keys and values written equal the plain step's."""
    graphs, recording = _recording_backend()
    batch = SlotBatch(model, max_slots=16, max_model_len=1024, cuda_graphs=False)
    batch._shares_prefixes = False  # (a shared prefix's decode graphs read the cache; the extend step's not)
    batch._decode_step = compiled_decode_step(backend=recording)
    batch._extend_step = compiled_extend_step(backend=recording)
    assert batch.compile_now() > 0
    traced = len(graphs)
    assert traced > 2, "compile_now traced only the decode step's two graphs"  # + the extend step's parts
    # No compiled graph reads or writes the cache.
    assert not any("index_select" in str(n.target) for g in graphs for n in g.graph.nodes)

    batch._ensure_length(1024)
    generator = torch.Generator().manual_seed(0)
    for rows, span in ((8, 256), (16, 512), (8, 1024), (16, 1024)):
        slots = torch.randperm(16, generator=generator)[:rows]
        tokens = torch.randint(10, 1000, (rows, EXTEND_MAX_TOKENS), generator=generator)
        start = torch.randint(0, span - EXTEND_MAX_TOKENS, (rows,), generator=generator)
        positions = start[:, None] + torch.arange(EXTEND_MAX_TOKENS)
        last = torch.randint(0, EXTEND_MAX_TOKENS, (rows,), generator=generator)
        inputs = (slots, tokens, positions, last, span)
        fused = batch._fused_layers()  # as the engine calls it
        compiled = batch._extend_step(model, batch.keys, batch.values, *inputs, fused=fused)
        written = [t[slots].clone() for t in (*batch.keys, *batch.values)]
        plain = extend_step(model, batch.keys, batch.values, *inputs, fused=fused)
        torch.testing.assert_close(compiled, plain)
        for before, after in zip(written, (*batch.keys, *batch.values), strict=True):
            torch.testing.assert_close(before, after[slots])
    assert len(graphs) == traced, f"{len(graphs) - traced} more graphs traced after compile_now"


def test_a_step_whose_compilation_fails_falls_back_to_the_plain_step_and_says_so(model, caplog):
    """A machine where compiling fails (no working Triton, a compiler bug) still serves: `compile_now` logs one
    warning per step that failed and runs the plain decode and extend steps from then on."""
    torch._dynamo.reset()

    def broken(graph: torch.fx.GraphModule, example_inputs):
        raise RuntimeError("no compiler here")

    batch = SlotBatch(model, max_slots=16, max_model_len=1024, cuda_graphs=False)
    batch._decode_step = compiled_decode_step(backend=broken)
    batch._extend_step = compiled_extend_step(backend=broken)
    with caplog.at_level("WARNING", logger="agentrl.rollout.engines._slot_batch"):
        batch.compile_now()
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 2 and "decode step" in failures[0] and "extend step" in failures[1], failures
    assert batch._decode_step is decode_step and batch._extend_step is extend_step
    batch.admit([[5, 6, 7, 8]], [3], reserve=64)  # three rows of one prompt
    assert batch.decode([11] * batch.size).shape[0] == 3


def _scaled_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 0.5, dim=-1)


def test_a_step_part_runs_every_loop_nest_on_every_thread_whatever_its_traced_size():
    """Inductor's C++ backend runs a loop nest whose first-traced size, per thread, is below `cpp.min_chunk_size`
    on one thread; the engine traces its steps on small placeholders, after which a served step's softmax over a
    shared prefix ran on one thread of two. A step's part is compiled to run every loop on every thread; a plain
    compile of the same small softmax makes no parallel loop at all."""
    from torch._inductor.utils import run_and_get_code

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(4, 16)
        step_part = compile_step_part(_scaled_softmax, "inductor")
        out, step_code = run_and_get_code(step_part, x)
        torch.testing.assert_close(out, _scaled_softmax(x))
        _, plain_code = run_and_get_code(torch.compile(lambda t: _scaled_softmax(t)), x)
    finally:
        torch.set_num_threads(threads)
    assert "#pragma omp for" in "\n".join(step_code)
    assert "#pragma omp for" not in "\n".join(plain_code)

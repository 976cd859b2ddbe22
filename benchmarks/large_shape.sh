#!/usr/bin/env bash
# 3 GRPO steps of a Qwen2.5 shape with random weights on one GPU, with offload (docs/scaling.md, "A large shape on
# one GPU"). Builds the preset first (timed, its own peak RSS), then runs benchmarks/grpo_step.py once.
#
#   bash benchmarks/large_shape.sh 7b param    # 7B, bf16 master weights, parameter + optimizer offload (H100 or H200)
#   bash benchmarks/large_shape.sh 7b optim    # 7B, bf16 master weights on the GPU, optimizer offload (H200)
#   bash benchmarks/large_shape.sh 3b param    # 3B, float32 master weights (the default), parameter offload
#
# PYTHON (default: python) runs it; AGENTRL_CACHE (default /tmp/agentrl-cache) holds the built preset. A dry run of
# the same keys on CPU: MODEL=tiny:qwen2 DEVICE=cpu MAX_TOKENS=16 bash benchmarks/large_shape.sh 7b param
set -euo pipefail
size=${1:-7b}
mode=${2:-param}
PYTHON=${PYTHON:-python}
export AGENTRL_CACHE=${AGENTRL_CACHE:-/tmp/agentrl-cache}
model=${MODEL:-tiny:qwen2.5-${size}-shape}
fsdp=actor_rollout_ref.actor.fsdp_config
case "$size/$mode" in
  7b/param) offload=("$fsdp.model_dtype=bfloat16" "$fsdp.param_offload=true" "$fsdp.optimizer_offload=true") ;;
  7b/optim) offload=("$fsdp.model_dtype=bfloat16" "$fsdp.optimizer_offload=true") ;;
  3b/param) offload=("$fsdp.param_offload=true" "$fsdp.optimizer_offload=true") ;;
  3b/optim) offload=("$fsdp.optimizer_offload=true") ;;
  *) echo "usage: $0 7b|3b param|optim" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
free -g | head -2
start=$(date +%s)
$PYTHON - "$model" <<'PY'
import resource, sys, time
from agentrl.models import resolve_model_path
start = time.perf_counter()
path = resolve_model_path(sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(f"BUILD {sys.argv[1]} -> {path}: {time.perf_counter() - start:.0f} s, peak RSS {peak:.1f} GiB", flush=True)
PY
du -sh "$AGENTRL_CACHE"/tiny/* | tail -3
$PYTHON benchmarks/grpo_step.py --trainers agentrl --model "$model" --dtype bfloat16 --device "${DEVICE:-cuda}" \
  --prompts 4 --n 4 --max-tokens "${MAX_TOKENS:-128}" --micro-batch 16 --steps 3 --rounds 1 --gradient-checkpointing on \
  --extra trainer.backend=ray trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.compile_decode=false \
  "${offload[@]}"
echo "TOTAL $(( $(date +%s) - start )) s (build + run)"

#!/usr/bin/env bash
# GPU checks on a device machine (docs/development.md), from the repo root, after the packed packages:
#   source .device/prelude.sh && bash scripts/gpu_check.sh tests|full|lora|ray1|offload|watch [OUT_DIR]
# tests: pytest tests/gpu. full/lora: 10 GRPO steps on the Qwen2.5-0.5B shape (bf16, 16 prompts x 8 answers x
# 256 tokens, local backend). ray1/ray2: 3 steps on the Ray backend with FSDP2 on 1/2 GPUs. offload: 2 steps of the
# 1.5B shape with parameter offload (64-token answers). STEPS=N changes the 10 steps of full and lora.
# watch: agentrl's side of benchmarks/grpo_step.py (STEPS, default 6; GRPO_ARGS adds its options) with Python's
# fault handler on; when no step ends for STALL_S seconds (default 50) it dumps every thread's stack into
# $out/watch.log (a stall's where, in one call).
set -uo pipefail
what=$1
out=${2:-${OUT:-outputs/gpu}}
mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 AGENTRL_CACHE=${AGENTRL_CACHE:-/tmp/agentrl-cache}
grpo=(
  actor_rollout_ref.model.path=tiny:qwen2.5-0.5b-shape actor_rollout_ref.model.dtype=bfloat16 sft.enable=false
  data.train_batch_size=16 actor_rollout_ref.rollout.n=8 data.max_response_length=256
  actor_rollout_ref.rollout.max_num_seqs=128 actor_rollout_ref.actor.ppo_mini_batch_size=16
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.optim.lr=1e-6
  trainer.total_training_steps=${STEPS:-10} trainer.test_freq=-1 trainer.val_before_train=false trainer.save_freq=-1
  "trainer.logger=[console]" trainer.default_local_dir=/tmp/agentrl-runs/$what
)
train() {
  python -m agentrl.cli train --config configs/arithmetic.yaml "${grpo[@]}" "$@" 2>&1 | tee "$out/$what.log" \
    | grep -E "^step|Error|error|Traceback|run folder" | cut -c1-400
  python - "/tmp/agentrl-runs/$what/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["timing/step"] for r in rows if "timing/step" in r][1:]  # the first step includes warm-up
peak = max(r.get("perf/max_memory_allocated_gb", 0.0) for r in rows)
print(f"median step {statistics.median(steps):.2f} s (steps 2..), peak {peak:.1f} GiB allocated per GPU")
PY
}
watch() {
  local log=$out/watch.log pid last=0 seen=$SECONDS n
  # shellcheck disable=SC2086  # GRPO_ARGS is a list of options
  PYTHONFAULTHANDLER=1 python benchmarks/grpo_step.py --only agentrl --steps "${STEPS:-6}" ${GRPO_ARGS:-} >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 3
    n=$(grep -c "^step" "$log")
    if [ "$n" != "$last" ]; then last=$n; seen=$SECONDS; fi
    if [ $((SECONDS - seen)) -gt "${STALL_S:-50}" ]; then
      echo "no step ended for ${STALL_S:-50} s after step $n: stacks in $log"; kill -ABRT "$pid"; sleep 3; break
    fi
  done
  grep -E "^step|RESULT" "$log" | cut -c1-400
  grep -E "ERROR|Traceback|Thread 0x|Current thread" -A12 "$log" | grep -v "site-packages/torch/nn" | cut -c1-200 | head -120
}
case $what in
  tests) python -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
  full) train ;;
  lora) train actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64 actor_rollout_ref.actor.optim.lr=1e-5 ;;
  ray1) train trainer.backend=ray trainer.total_training_steps=3 ;;
  ray2) train trainer.backend=ray trainer.n_gpus_per_node=2 trainer.total_training_steps=3 ;;
  offload) train trainer.backend=ray trainer.total_training_steps=2 actor_rollout_ref.model.path=tiny:qwen2.5-1.5b-shape \
    actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    data.max_response_length=64 ;;
  watch) watch ;;
  *) echo "unknown check $what" >&2; exit 2 ;;
esac

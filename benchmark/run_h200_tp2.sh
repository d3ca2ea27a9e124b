#!/usr/bin/env bash
# Two Xavier replicas of tensor_parallel_size 2 (four GPUs) through the user's path.
#
# Needs a 4-GPU kind (nvidia-h200-x4), not lent when this was written; the calls are
# those of run_h200_vllm.sh (vLLM bundle in two pieces, then .whl), with the kind:
#   run(kind="nvidia-h200-x4", carry=[".vllm-chunks-nomoe/c01"],
#       command="bash .vllm-chunks-nomoe/c01/plan.sh stash c01")
#   run(kind="nvidia-h200-x4", carry=[".vllm-chunks-nomoe/c02", ".whl"],
#       command="bash .vllm-chunks-nomoe/c02/plan.sh stash c02 &&
#                bash .vllm-chunks-nomoe/c02/plan.sh install && bash benchmark/run_h200_tp2.sh")
# It runs run_h200_vllm.sh's deployments "on" (Xavier, 256MiB device tier per rank)
# and "off" (the baseline) with --tensor-parallel-size 2 added to every launch: the
# launcher gives replica 0 GPUs 0,1 and replica 1 GPUs 2,3, and each rank of a
# replica loads its KV heads from the same rank of the other (the model has 2 KV
# heads: one per rank). The correctness phase compares Xavier's greedy outputs with
# the baseline's; report.md has the TTFT and hit tables.
#
# DRY_RUN=1 checks, on any machine, that the launch options are accepted and how the
# four GPUs would be placed, and prints the command it would run.
set -euo pipefail
TP=${TP:-2}
BASE_ENGINE="--gpu-memory-utilization 0.3 --max-model-len 9216 --enforce-eager"
export LAUNCH_ENGINE="${LAUNCH_ENGINE:-$BASE_ENGINE} --tensor-parallel-size $TP"
export DEPLOYS=${DEPLOYS:-on off}
check() {
  python3 - "$TP" <<'PY'
import sys, tempfile
from xinference.core.options import LaunchSpec
from xinference.core.placement import plan_replicas
tp = int(sys.argv[1])
spec = LaunchSpec.from_options(
    model_path=tempfile.mkdtemp(), replica=2, enable_xavier=True,
    xavier_gpu_cache_bytes="256MiB", tensor_parallel_size=tp,
)
plan = plan_replicas(2, gpus=[str(i) for i in range(2 * tp)], xavier=True,
                     user_env={}, devices_per_replica=tp)
print(f"accepted: {spec.xavier.describe()}, tensor_parallel_size "
      f"{spec.engine.tensor_parallel_size}")
for p in plan:
    print(f"replica {p.rank}: CUDA_VISIBLE_DEVICES={p.gpu}")
PY
}
if [[ -n ${DRY_RUN:-} ]]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} check
  echo "would run: LAUNCH_ENGINE='$LAUNCH_ENGINE' DEPLOYS='$DEPLOYS'" \
    "bash benchmark/run_h200_vllm.sh"
  exit 0
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if (( gpus < 2 * TP )); then
  echo "two replicas of tensor_parallel_size $TP need $(( 2 * TP )) GPUs; this" \
    "machine has $gpus" >&2
  exit 2
fi
exec bash benchmark/run_h200_vllm.sh

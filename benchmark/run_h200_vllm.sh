#!/usr/bin/env bash
# Xavier inside real vLLM on one lent H200, through the user's path, in one call.
#
# vLLM first (two calls back to back, from the project root; the machine stays
# warm about 30 s between calls, and /tmp/site lives only while it is warm):
#   here:  KEEP_MOE=0 OUT=$PWD/.vllm-chunks-nomoe bash ../shared/device/vllm-gpu-chunks.sh
#          bash ../shared/device/make-wheels.sh      # .whl: xoscar, NIXL, uvicorn...
#          python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#            --platform manylinux2014_x86_64 -d .whl argon2-cffi argon2-cffi-bindings \
#            cffi pycparser pyjwt                 # the server's authentication imports
#   run(carry=[".vllm-chunks-nomoe/c01"],
#       command="bash .vllm-chunks-nomoe/c01/plan.sh stash c01")
#   run(carry=[".vllm-chunks-nomoe/c02", ".whl"],
#       command="bash .vllm-chunks-nomoe/c02/plan.sh stash c02 &&
#                bash .vllm-chunks-nomoe/c02/plan.sh install && bash benchmark/run_h200_vllm.sh")
# (KEEP_MOE=0 drops the MoE kernels a dense model never loads: the bundle is then
# 78 MiB, so the second piece and .whl travel together.) Later warm calls need no
# carry (.site and /tmp/site stay while the machine is warm):
#   run(command="SKIP_WHEELS=1 DEPLOYS='on-ca v1 xl' bash benchmark/run_h200_vllm.sh")
# Each deployment takes 1.5-2 minutes to launch; BUDGET_S keeps one call inside the
# tool's 10 minutes.
#
# What it does: builds a random-weight Qwen2.5-0.5B-shaped model (24 layers, hidden
# 896, 14 heads, 2 KV heads, head dim 64, BF16, the real MLP width) on the machine,
# starts `xinference-local`, and for each deployment in DEPLOYS launches two replicas
# on the one GPU with `xinference launch`, runs benchmark/serving_benchmark.py
# through the OpenAI API, and terminates it:
#   on     Xavier, 256MiB device tier, round robin: correctness, ttft, shared, unique
#   off    no Xavier: the same phases (the baseline)
#   on-ca  Xavier with --router cache-aware: shared
#   v1     Xavier on vLLM's V1 model runner, per-layer caches: correctness, ttft
#   xl     Xavier on the V1 runner with --xavier-cross-layer-blocks (one allocation;
#          vLLM's V2 runner, the default for Qwen2, does not offer it): same phases
# Logs and JSON go to $LOGS, packed at the end into $OUT/run-<time>.tgz (a call
# brings back at most 8 files) beside report.md and summary.txt; the last lines
# print the report's tables.
set -uo pipefail
DEST=${OUT:-/tmp}
LOGS=${LOGS:-/tmp/xavier-h200-vllm}
BUDGET_S=${BUDGET_S:-560}        # stop starting deployments past this
DEPLOYS=${DEPLOYS:-on off}
# The engine options every deployment gets, the model's shape, the TTFT lengths.
LAUNCH_ENGINE=${LAUNCH_ENGINE:---gpu-memory-utilization 0.3 --max-model-len 9216 --enforce-eager}
MODEL_SHAPE=${MODEL_SHAPE:-intermediate_size=4864, max_position_embeddings=16384}
TTFT_LENGTHS=${TTFT_LENGTHS:-512 2048 8192}
WORKLOAD_ARGS=${WORKLOAD_ARGS:-}   # e.g. "--warm 40 --groups 4" for a dry run on a CPU
ONLY_PHASES=${ONLY_PHASES:-}       # e.g. "unique": these phases for every deployment
# e.g. 20: py-spy the engine cores this long per deployment. Needs py-spy in .whl:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl py-spy
PROFILE_S=${PROFILE_S:-}
PROFILE_DELAY_S=${PROFILE_DELAY_S:-15}  # ... starting this long after the launch
mkdir -p "$LOGS"
if [[ -z ${SKIP_WHEELS:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target .site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$PWD/.site:/tmp/site PATH=/tmp/site/bin:$PWD/.site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/xavier-qwen25-05b-shaped}
{
  nvidia-smi -L
  python3 -c "import importlib.metadata as m, torch; print('torch', torch.__version__, \
'vllm', m.version('vllm'), 'xoscar', m.version('xoscar'), 'nixl', m.version('nixl'))"
} > "$LOGS/env.txt" 2>&1
python3 - "$MODEL" "$MODEL_SHAPE" >> "$LOGS/env.txt" 2>&1 <<'PY' || { cat "$LOGS/env.txt"; exit 1; }
import sys, time
from xinference.model.llm.tiny_model import qwen25_05b_shaped
started = time.time()
qwen25_05b_shaped(sys.argv[1], **eval(f"dict({sys.argv[2]})"))
print(f"model built in {time.time() - started:.0f} s")
PY

# shellcheck source=benchmark/local_server.sh
source "$(dirname "$0")/local_server.sh"
deploy() {  # deploy LABEL PHASES [launch options...]
  local label=$1 phases=${ONLY_PHASES:-$2}; shift 2
  if (( SECONDS > BUDGET_S - 90 )); then
    echo "skip $label: ${SECONDS}s of ${BUDGET_S}s used" | tee -a "$LOGS/summary.txt"
    return
  fi
  echo "== $label ($SECONDS s)" | tee -a "$LOGS/summary.txt"
  # shellcheck disable=SC2086  # LAUNCH_ENGINE is a list of options
  xi 300 launch --model-path "$MODEL" --model-uid "$label" --replica 2 \
    $LAUNCH_ENGINE "$@" \
    >> "$LOGS/launch-$label.log" 2>&1 || {
      echo "launch $label failed"; tail -5 "$LOGS/launch-$label.log"; return; }
  tail -4 "$LOGS/launch-$label.log" | tee -a "$LOGS/summary.txt"
  [[ -n $PROFILE_S ]] && profile_engines "$label" &
  local left=$(( BUDGET_S - SECONDS - 20 ))
  if (( left < 30 )); then echo "no time left for $label's phases"; return; fi
  timeout "$left" python3 benchmark/serving_benchmark.py run --endpoint "$EP" \
    --model "$label" --label "$label" --phases "$phases" --json "$LOGS/$label.json" \
    --lengths $TTFT_LENGTHS $WORKLOAD_ARGS --terminate 2>&1 | tee -a "$LOGS/summary.txt"
  # The benchmark terminates the model; if it failed first, terminate here (prints
  # counters).
  if (( PIPESTATUS[0] != 0 )); then
    xi 60 terminate --model-uid "$label" >> "$LOGS/summary.txt" 2>&1 || true
  fi
}

profile_engines() {  # profile_engines LABEL: py-spy every engine core, in the background
  # (needs py-spy in .whl; raw collapsed stacks, one file per process, per thread),
  # and the replicas' sub-pools and xinference-local too (files named by role);
  # meanwhile the busiest threads of the host (top) and the GPU's utilisation.
  sleep "$PROFILE_DELAY_S"
  local pid role
  pgrep -f "VLLM::EngineCore" > /dev/null || ps -eo pid,args > "$LOGS/profile-$1-ps.txt"
  for pid in $(pgrep -f "VLLM::EngineCore") \
    $(grep -o "pid [0-9]*" "$LOGS/launch-$1.log" | cut -d' ' -f2) $SERVER_PID; do
    role=engine
    [[ $pid == "$SERVER_PID" ]] && role=local
    grep -q "pid $pid " "$LOGS/launch-$1.log" && role=subpool
    py-spy record --pid "$pid" --duration "$PROFILE_S" --rate 250 --format raw \
      --threads --nonblocking -o "$LOGS/profile-$1-$role-$pid.txt" \
      > "$LOGS/profile-$1-$role-$pid.log" 2>&1 &
  done
  top -b -H -d "$(( PROFILE_S / 2 ))" -n 3 -w 400 > "$LOGS/top-$1.txt" 2>&1 &
  timeout "$PROFILE_S" nvidia-smi --query-gpu=utilization.gpu,utilization.memory \
    --format=csv,noheader -lms 500 > "$LOGS/gpu-util-$1.txt" 2>&1 &
  wait
}

XAVIER=(--enable-xavier --xavier-gpu-cache-bytes 256MiB)
v2_started=; v1_started=
for d in $DEPLOYS; do
  case $d in
    on|off|on-ca)
      if [[ -z $v2_started ]]; then stop_server; start_server 9997 || exit 1; v2_started=1; fi ;;
    v1|xl)
      if [[ -z $v1_started ]]; then
        stop_server; start_server 9998 VLLM_USE_V2_MODEL_RUNNER=0 || exit 1; v1_started=1
      fi ;;
  esac
  case $d in
    on) deploy on correctness,ttft,shared,unique "${XAVIER[@]}" ;;
    off) deploy off correctness,ttft,shared,unique ;;
    on-ca) deploy on-ca shared "${XAVIER[@]}" --router cache-aware ;;
    v1) deploy v1 correctness,ttft "${XAVIER[@]}" ;;
    xl) deploy xl correctness,ttft "${XAVIER[@]}" --xavier-cross-layer-blocks ;;
    *) echo "unknown deployment $d" ;;
  esac
done
stop_server
# vLLM's optional NIXL expert-parallel import warns in every engine: not ours.
grep -h -i "cross layer\|Traceback\|Error" "$LOGS"/local-*.log | grep -v import_utils \
  | sed 's/^.*\] //' | sort | uniq -c | sort -rn | head -20 > "$LOGS/highlights.txt"
python3 benchmark/serving_benchmark.py report "$LOGS"/*.json > "$LOGS/report.md" 2>&1
if [[ $DEST != "$LOGS" ]]; then
  tar czf "$DEST/run-$(date +%H%M%S).tgz" -C "$LOGS" .
  cp "$LOGS/report.md" "$LOGS/summary.txt" "$DEST/"
fi
cat "$LOGS/summary.txt" "$LOGS/highlights.txt" "$LOGS/report.md"

#!/usr/bin/env bash
# Issue 29: Xavier on an 8B-class deployment, side by side with routing alone, on
# one lent H200, through the user's path (xinference-local, xinference launch, the
# OpenAI API). One call runs the deployments in DEPLOYS (one or two, both up at
# once: two replicas each on the one GPU) through the workloads in WORKLOADS, in
# that order, each workload on every deployment before the next workload, and
# prints the tables with ratios against the first deployment of DEPLOYS (BASE).
#
# Deployments (model: the registry's llama-3.1-8b-shaped, --load-format dummy):
#   off-rr    Xavier off, round robin
#   routing   routing only: Xavier on with --no-xavier-remote-loads, cache-aware
#   on-rr     Xavier on, round robin
#   on-ca     Xavier on, cache-aware
#   fast-rr   on-rr with --xavier-fast-path (issue 28: synchronous lease-free hits)
# Workloads:
#   misstax   no shared prefixes (serving_benchmark.py unique), run three times on
#             each deployment, alternating (pairs 1-3, labels NAME#k; pair 2 in
#             the reverse order)
#   shared    the seed's: 12 prefixes of 1,536 tokens cold, 600 warm at
#             concurrency 16, 64 output tokens (serving_benchmark.py shared)
#   docqa     16 documents of 8,192 tokens x 4 questions, concurrency 8
#   ttft3     TTFT on replica B at 2,048 / 8,192 / 32,768 tokens (TTFT_LENGTHS):
#             local hit, remote hit, miss (round robin deployments only)
#
# The plan (benchmark/results/h200.md, "Issue 29: planned, not run"), from the
# project root, vLLM brought as run_h200_vllm.sh says (two pieces, machine warm):
#   run(carry=[".vllm-chunks-nomoe/c01"], command="bash .vllm-chunks-nomoe/c01/plan.sh stash c01")
#   run(carry=[".vllm-chunks-nomoe/c02", ".whl"], command="bash .vllm-chunks-nomoe/c02/plan.sh
#       stash c02 && bash .vllm-chunks-nomoe/c02/plan.sh install &&
#       DEPLOYS='off-rr on-rr' WORKLOADS='misstax shared docqa' bash benchmark/run_h200_8b.sh")
#   run(command="SKIP_WHEELS=1 DEPLOYS='off-rr on-ca' WORKLOADS='shared docqa' bash benchmark/run_h200_8b.sh")
#   run(command="SKIP_WHEELS=1 DEPLOYS='routing on-ca' WORKLOADS='shared docqa' bash benchmark/run_h200_8b.sh")
#   run(command="SKIP_WHEELS=1 DEPLOYS='on-rr' WORKLOADS='ttft3' MAX_MODEL_LEN=33792 GPU_UTIL=0.4 bash benchmark/run_h200_8b.sh")
# Issue 28, the fast path against the default on one server (ttft3 per length:
# remote - local, remote/miss, and the actor-measured load where a load has one):
#   run(command="SKIP_WHEELS=1 DEPLOYS='on-rr fast-rr' WORKLOADS='ttft3' MAX_MODEL_LEN=33792 GPU_UTIL=0.2 bash benchmark/run_h200_8b.sh")
#
# A dry run on a CPU (vllm-cpu, the registry's llama-3.1-shaped-mini, token counts
# scaled down; needs the vLLM lock):
#   DRY_RUN=1 DEPLOYS='off-rr on-rr' WORKLOADS='misstax shared docqa ttft3' \
#     flock /tmp/xavier-vllm.lock bash benchmark/run_h200_8b.sh
set -uo pipefail
DEST=${OUT:-/tmp}
LOGS=${LOGS:-/tmp/xavier-h200-8b}
DEPLOYS=${DEPLOYS:-off-rr on-rr}
WORKLOADS=${WORKLOADS:-shared docqa}
BASE=${BASE:-${DEPLOYS%% *}}
BUDGET_S=${BUDGET_S:-560}        # no workload starts past BUDGET_S - its estimate
MODEL_NAME=${MODEL_NAME:-llama-3.1-8b-shaped}
SCALE=${SCALE:-1}
# Two deployments of two 8B replicas share the GPU: per engine 16 GB of weights and
# about 9 GB of KV (70,000 tokens) at 0.18, plus the Xavier device tier.
GPU_UTIL=${GPU_UTIL:-0.18}
TIER=${TIER:-6GiB}               # each replica's device tier (the 0.5B runs: 256MiB)
MAX_MODEL_LEN=${MAX_MODEL_LEN:-9216}
ENGINE=${ENGINE:---enforce-eager --load-format dummy}
UNIQUE_WARM=${UNIQUE_WARM:-300}  # miss-tax runs: 3 pairs x 2 deployments of these
PORT=${PORT:-9997}
if [[ -n ${DRY_RUN:-} ]]; then   # CPU: vllm-cpu, a two-layer stand-in, 1/16 tokens
  MODEL_NAME=llama-3.1-shaped-mini SCALE=0.0625 TIER=64MiB MAX_MODEL_LEN=4096
  ENGINE="--enforce-eager --load-format dummy --block-size 32"
  GPU_UTIL= SKIP_WHEELS=1 CALIBRATE=
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi
CALIBRATE=${CALIBRATE-1}
mkdir -p "$LOGS"
if [[ -z ${SKIP_WHEELS:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target .site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$PWD/.site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PWD/.site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export XINFERENCE_HOME=${XINFERENCE_HOME:-$LOGS/home}
PY=${PYTHON:-python3}

note() { echo "$*" | tee -a "$LOGS/summary.txt"; }
scaled() { $PY -c "print(max(1, round($1 * $SCALE)))"; }

{
  date -u
  nvidia-smi -L 2>/dev/null || echo "no GPU (dry run)"
  $PY -c "import importlib.metadata as m, torch
for name in ('vllm', 'vllm-cpu'):
    try: print('vllm', m.version(name))
    except m.PackageNotFoundError: pass
print('torch', torch.__version__, 'xoscar', m.version('xoscar'))"
  echo "DEPLOYS=$DEPLOYS WORKLOADS=$WORKLOADS BASE=$BASE MODEL=$MODEL_NAME SCALE=$SCALE"
  echo "GPU_UTIL=$GPU_UTIL TIER=$TIER MAX_MODEL_LEN=$MAX_MODEL_LEN ENGINE=$ENGINE"
} > "$LOGS/env.txt" 2>&1
note "$(tail -2 "$LOGS/env.txt")"

# The host's calibration: the seed's xoscar load path on VRAM (1.5-1.8 ms p50 on the
# fastest lent host so far, 2.9-3.2 ms on slow ones), so calls on different hosts
# can be told apart.
if [[ -n $CALIBRATE ]]; then
  timeout 90 $PY benchmark/transport_benchmark.py --device cuda --loads 100 \
    --cases xoscar,nixl-slab --json "$LOGS/calibration.json" > "$LOGS/calibration.log" 2>&1
  note "calibration rc=$? $(grep -E '^\| (xoscar|nixl-slab)' "$LOGS/calibration.log" | head -4)"
fi

# shellcheck source=benchmark/local_server.sh
source "$(dirname "$0")/local_server.sh"

options_of() {  # the launch options of a deployment
  local xavier=(--enable-xavier --xavier-gpu-cache-bytes "$TIER")
  case $1 in
    off-rr) ;;
    routing) echo "${xavier[*]} --router cache-aware --no-xavier-remote-loads" ;;
    on-rr) echo "${xavier[*]}" ;;
    on-ca) echo "${xavier[*]} --router cache-aware" ;;
    fast-rr) echo "${xavier[*]} --xavier-fast-path" ;;
    *) echo "unknown deployment $1" >&2; return 1 ;;
  esac
}
launch() {  # launch NAME: two replicas on the one GPU
  local extra
  extra=$(options_of "$1") || return 1
  # shellcheck disable=SC2086  # word lists
  xi 420 launch --model-name "$MODEL_NAME" --model-uid "$1" --replica 2 \
    --max-model-len "$MAX_MODEL_LEN" ${GPU_UTIL:+--gpu-memory-utilization $GPU_UTIL} \
    $ENGINE $extra > "$LOGS/launch-$1.log" 2>&1
}

trap stop_server EXIT  # a failed or timed-out call leaves no server or engine
start_server "$PORT" || exit 1
# The model directory is written before the launches (seconds; both use it).
$PY -c "from xinference.core.registry import resolve_model; print(resolve_model('$MODEL_NAME'))" \
  >> "$LOGS/env.txt" 2>&1
LIVE=()
pids=()
for d in $DEPLOYS; do  # launched together: one engine start's time for both
  launch "$d" &
  pids+=($!)
done
index=0
for d in $DEPLOYS; do
  if wait "${pids[$index]}"; then
    LIVE+=("$d"); note "launched $d ($SECONDS s): $(grep -h '^Xavier' "$LOGS/launch-$d.log")"
  else
    note "launch $d failed:"; tail -8 "$LOGS/launch-$d.log" | tee -a "$LOGS/summary.txt"
  fi
  index=$((index + 1))
done

PREFIX=$(scaled 1536); DOC=$(scaled 8192)
SHARED_ARGS="--prefix-tokens $PREFIX --warm $(scaled 600) --groups 12 --concurrency 16 --max-tokens 64"
UNIQUE_ARGS="--prefix-tokens $PREFIX --warm $(scaled "$UNIQUE_WARM") --groups 12 --concurrency 16 --max-tokens 64"
room() {  # room ESTIMATE_S: whether a step of about that long still fits
  if (( SECONDS + $1 > BUDGET_S )); then note "skip $2: ${SECONDS}s used of ${BUDGET_S}s"; return 1; fi
}
mkdir -p "$LOGS/json"
bench() {  # bench NAME LABEL FILE SCRIPT ARGS...: one benchmark run, JSON to FILE
  local name=$1 label=$2 file=$3 script=$4; shift 4
  timeout $(( BUDGET_S + 30 - SECONDS )) $PY "benchmark/$script" run --endpoint "$EP" \
    --model "$name" --label "$label" --json "$LOGS/json/$file.json" "$@" 2>&1 \
    | tee -a "$LOGS/summary.txt"
}
for workload in $WORKLOADS; do
  case $workload in
    misstax)
      for k in 1 2 3; do
        order=("${LIVE[@]}")  # the second pair runs the other way round: position
        (( k == 2 )) && order=($(printf '%s\n' "${LIVE[@]}" | tac))  # bias shows
        for d in "${order[@]}"; do
          # shellcheck disable=SC2086
          room 45 "misstax $d#$k" && bench "$d" "$d#$k" "$d-unique-$k" serving_benchmark.py \
            --phases unique $UNIQUE_ARGS
        done
      done ;;
    shared)
      for d in "${LIVE[@]}"; do
        # shellcheck disable=SC2086
        room 60 "shared $d" && bench "$d" "$d" "$d-shared" serving_benchmark.py \
          --phases shared $SHARED_ARGS
      done ;;
    docqa)
      for d in "${LIVE[@]}"; do
        room 40 "docqa $d" && bench "$d" "$d" "$d-docqa" serving_8b.py --phases docqa \
          --scale "$SCALE" --concurrency "${DOCQA_CONCURRENCY:-8}"
      done ;;
    ttft3)
      for d in "${LIVE[@]}"; do
        [[ $d == *-rr ]] || { note "ttft3 needs round robin: not on $d"; continue; }
        # shellcheck disable=SC2086  # TTFT_LENGTHS: a word list
        room 90 "ttft3 $d" && bench "$d" "$d" "$d-ttft3" serving_8b.py --phases ttft3 \
          --scale "$SCALE" --runs "${TTFT_RUNS:-5}" --lengths ${TTFT_LENGTHS:-2048 8192 32768}
      done ;;
    *) note "unknown workload $workload" ;;
  esac
done
for d in "${LIVE[@]}"; do
  xi 90 terminate --model-uid "$d" >> "$LOGS/terminate.log" 2>&1
done
stop_server
grep -h -i "Traceback\|Error" "$SERVER_LOG" | grep -v import_utils | sed 's/^.*\] //' \
  | sort | uniq -c | sort -rn | head -20 > "$LOGS/highlights.txt"
$PY benchmark/serving_8b.py report --base "$BASE" "$LOGS"/json/*.json \
  > "$LOGS/report.md" 2>&1
if [[ $DEST != "$LOGS" ]]; then
  tar czf "$DEST/run8b-$(date +%H%M%S).tgz" -C "$LOGS" --exclude home .
  cp "$LOGS/report.md" "$LOGS/summary.txt" "$DEST/"
fi
cat "$LOGS/highlights.txt" "$LOGS/report.md"

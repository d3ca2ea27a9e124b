#!/usr/bin/env bash
# The GPU-truth run on one lent H200 (device tool), in one call:
#   carry [".whl"], command: bash benchmark/run_h200.sh
# .whl/ comes from ../shared/device/make-wheels.sh plus pytest, pytest-asyncio and
# pytest-timeout wheels (the GPU image lacks pytest-asyncio). Logs go to $OUT.
# Phases, each bounded so that one call fits the session's device time (PHASES
# picks a subset, e.g. PHASES="floor transport"):
#   floor      raw NIXL READ/WRITE between two processes (benchmark/nixl_floor.py);
#   transport  the transport benchmark on VRAM (xoscar slabs vs direct NIXL), once
#              per engine allocation in ALLOCATIONS, with TRANSPORT_ARGS;
#   tests      every CUDA-marked Xavier test (CUDA IPC mapping, NIXL VRAM loads,
#              BF16 bit patterns, demotion and reload, scatter graph replays);
#   graphs     the per-layer scatter eagerly and as CUDA graph replays
#              (XAVIER_SCATTER_GRAPHS): the scatter benchmark, then the per-layer
#              transport benchmark (nixl-slab, nixl-read) without and with
#              --scatter-graphs. Not in the default PHASES.
# Every phase runs with UCX_PROTO_INFO=y; *-protocols.txt sums up which protocol
# and transport UCX chose for each VRAM operation (cuda_ipc, or a TCP fallback).
set -uo pipefail
OUT=${OUT:-/tmp/xavier-h200}
mkdir -p "$OUT"
if [[ -z ${SKIP_WHEELS:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target .site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$PWD/.site UCX_MEMTYPE_CACHE=n PYTHONUNBUFFERED=1
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
{
  nvidia-smi -L
  python3 -c "import importlib.metadata as m, torch; print('torch', torch.__version__, \
'xoscar', m.version('xoscar'), 'nixl', m.version('nixl'))"
  echo "UCX_TLS=$UCX_TLS"
} > "$OUT/env.txt" 2>&1
phases=${PHASES:-floor transport tests}
# UCX prints a table per new (operation, memory types) pair; keep the VRAM ones.
protocols() {
  grep -A6 "from cuda\|into cuda" "$1" | grep -E "from cuda|into cuda|\.\.inf" \
    | sed 's/^\[[^]]*\] \[[^]]*\] *//' | sort | uniq -c > "$2"
}
if [[ $phases == *floor* ]]; then
  UCX_PROTO_INFO=y timeout "${FLOOR_TIMEOUT:-150}" python3 benchmark/nixl_floor.py \
    --device cuda --variants "${FLOOR_VARIANTS:-default,get-zcopy-on}" \
    --json "$OUT/floor.json" > "$OUT/floor.log" 2>&1
  echo "floor rc=$?" >> "$OUT/env.txt"
  protocols "$OUT/floor.log" "$OUT/floor-protocols.txt"
fi
if [[ $phases == *transport* ]]; then
  # One run per engine allocation in ALLOCATIONS (e.g. "per-layer cross-layer");
  # TRANSPORT_ARGS adds options to each (e.g. "--cases nixl-slab,nixl-read").
  for allocation in ${ALLOCATIONS:-per-layer}; do
    # shellcheck disable=SC2086  # TRANSPORT_ARGS is a list of options
    UCX_PROTO_INFO=y timeout "${BENCH_TIMEOUT:-180}" python3 \
      benchmark/transport_benchmark.py --device cuda --loads "${LOADS:-200}" \
      --engine-allocation "$allocation" ${TRANSPORT_ARGS:-} \
      --json "$OUT/transport-$allocation.json" > "$OUT/transport-$allocation.log" 2>&1
    echo "transport benchmark ($allocation) rc=$?" >> "$OUT/env.txt"
  done
  cat "$OUT"/transport-*.log > "$OUT/transport-all.txt"
  protocols "$OUT/transport-all.txt" "$OUT/transport-protocols.txt"
  rm "$OUT/transport-all.txt"
fi
if [[ $phases == *graphs* ]]; then
  timeout "${SCATTER_TIMEOUT:-120}" python3 benchmark/scatter_benchmark.py \
    --device cuda --json "$OUT/scatter.json" > "$OUT/scatter.log" 2>&1
  echo "scatter benchmark rc=$?" >> "$OUT/env.txt"
  for graphs in "" --scatter-graphs; do
    name=per-layer${graphs:+-graphs}
    timeout "${BENCH_TIMEOUT:-180}" python3 benchmark/transport_benchmark.py \
      --device cuda --loads "${LOADS:-200}" --engine-allocation per-layer \
      --cases nixl-slab,nixl-read --breakdown $graphs \
      --json "$OUT/transport-$name.json" > "$OUT/transport-$name.log" 2>&1
    echo "transport benchmark ($name) rc=$?" >> "$OUT/env.txt"
  done
fi
xavier=tests/model/llm/vllm/xavier
if [[ $phases == *tests* ]]; then
  UCX_PROTO_INFO=y timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m cuda -q -s -rA \
    -p no:cacheprovider "$xavier" --ignore="$xavier/connector" \
    > "$OUT/cuda-tests.log" 2>&1
  echo "cuda tests rc=$?" >> "$OUT/env.txt"
  protocols "$OUT/cuda-tests.log" "$OUT/tests-protocols.txt"
  grep -E "passed|failed|PASSED|FAILED|SKIPPED|ERROR" "$OUT/cuda-tests.log" \
    > "$OUT/cuda-tests-summary.txt"
fi
cat "$OUT/env.txt" "$OUT"/*-protocols.txt "$OUT/cuda-tests-summary.txt" 2>/dev/null
grep "^|" "$OUT/floor.log" 2>/dev/null
grep -E "^\||graphs" "$OUT/scatter.log" 2>/dev/null
grep -h -E "^\||peer check|^UCX|^device |^scatter graphs" "$OUT"/transport-*.log \
  2>/dev/null
# PACK=1: everything in one archive (a device call brings back at most 8 files).
if [[ -n ${PACK:-} ]]; then
  tar czf /tmp/h200-run.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* \
    && mv /tmp/h200-run.tgz "$OUT/"
fi

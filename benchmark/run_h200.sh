#!/usr/bin/env bash
# The GPU-truth run on one lent H200 (device tool), in one call:
#   carry [".whl"], command: bash benchmark/run_h200.sh
# .whl/ comes from ../shared/device/make-wheels.sh plus pytest, pytest-asyncio and
# pytest-timeout wheels (the GPU image lacks pytest-asyncio). Logs go to $OUT.
# Phases, each bounded so that one call fits the session's device time:
#   1. every CUDA-marked Xavier test (CUDA IPC mapping, NIXL VRAM loads, BF16 bit
#      patterns, demotion and reload), with UCX's protocol choices logged;
#   2. the transport benchmark on VRAM (xoscar slabs vs direct NIXL).
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
xavier=tests/model/llm/vllm/xavier
# UCX prints the protocol (and transport) it picks for each new memory-type pair;
# the VRAM->VRAM lines show whether cuda_ipc or a TCP fallback carried the bytes.
UCX_PROTO_INFO=y timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m cuda -q -s -rA \
  -p no:cacheprovider "$xavier" --ignore-glob="*v1_connector*" \
  --ignore-glob="*worker_side*" --ignore-glob="*scheduler_side*" \
  > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests rc=$?" >> "$OUT/env.txt"
grep -A6 "from cuda" "$OUT/cuda-tests.log" | grep -E "from cuda|\.\.inf" \
  | sed 's/^\[[^]]*\] \[[^]]*\] *//' | sort | uniq -c > "$OUT/ucx-vram-protocols.txt"
grep -E "passed|failed|PASSED|FAILED|SKIPPED|ERROR" "$OUT/cuda-tests.log" \
  > "$OUT/cuda-tests-summary.txt"
if [[ -f benchmark/transport_benchmark.py ]]; then
  timeout "${BENCH_TIMEOUT:-120}" python3 benchmark/transport_benchmark.py \
    --device cuda --loads "${LOADS:-200}" --json "$OUT/transport.json" \
    > "$OUT/transport.log" 2>&1
  echo "transport benchmark rc=$?" >> "$OUT/env.txt"
fi
cat "$OUT/env.txt" "$OUT/cuda-tests-summary.txt" "$OUT/ucx-vram-protocols.txt"
tail -n 25 "$OUT/transport.log" 2>/dev/null

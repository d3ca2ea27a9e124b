#!/usr/bin/env bash
# Shows that the deadline and cancellation tests fail when what they test is
# removed: for each edit below, a scratch copy of the tree gets that one edit and
# runs the tests meant to catch it. Expect "failed" on every line but the last
# (a redundant deadline, see benchmark/results/reliability.md). Slow: ~15 min.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
X=xinference/model/llm/vllm/xavier
T=tests/model/llm/vllm/xavier

# mutate NAME FILE OLD NEW TESTS [-k EXPR]
mutate() {
  local name=$1 file=$2 old=$3 new=$4
  shift 4
  rm -rf "$scratch/tree" && mkdir "$scratch/tree"
  (cd "$root" && tar --exclude=.git --exclude=.venv -cf - xinference tests setup.cfg pyproject.toml) |
    (cd "$scratch/tree" && tar xf -)
  OLD=$old NEW=$new "$py" - "$scratch/tree/$file" <<'PY' || { echo "$name: edit did not apply"; return; }
import os, sys
path = sys.argv[1]
text = open(path).read()
assert os.environ["OLD"] in text, "pattern not found"
open(path, "w").write(text.replace(os.environ["OLD"], os.environ["NEW"]))
PY
  (cd "$scratch/tree" && timeout 600 env PYTHONPATH="$scratch/tree" "$py" -m pytest -q -p no:cacheprovider "$@" 2>&1 |
    grep -E "[0-9]+ (passed|failed)" | tail -1 | sed "s/^/$name: /")
}

mutate with_deadline_awaits $X/aio.py \
  "result: T = await xo.wait_for(awaitable, timeout)" "result: T = await awaitable" \
  $T/connector/test_scheduler.py $T/connector/test_worker_mapping.py \
  "$T/test_stalled_peers.py::test_a_load_from_a_stopped_holder_fails_in_time_and_frees_all[xoscar-push]" \
  -k "hanging or deadline or mapping or xoscar"
mutate actor_deadline_awaits $X/actor/transfer_actor.py \
  "return await xo.wait_for(call, self._config.rpc_timeout_s)" "return await call" \
  $T/test_stalled_peers.py -k staging
mutate serve_push_no_timeout $X/transports/xoscar/gpu_transfer.py \
  "await xo.wait_for(
                    xo.copy_to([view], [req.dest]), timeout=self.copy_timeout_s
                )" "await xo.copy_to([view], [req.dest])" \
  $T/test_stalled_peers.py -k push_into
mutate cpu_read_no_timeout $X/transports/cpu_tier.py \
  "reply = await xo.wait_for(holder_ref.read_cpu_rows(lease_id, batch), timeout_s)" \
  "reply = await holder_ref.read_cpu_rows(lease_id, batch)" \
  $T/test_stalled_peers.py -k cpu-tier
mutate nixl_read_no_deadline $X/transports/nixl/reads.py \
  "started + timeout_s)" "started + 1e9)" \
  $T/test_stalled_peers.py -k nixl-read
mutate release_no_deadline $X/actor/loads.py \
  "await with_deadline(holder.release(req.grant.lease_id), rpc_timeout_s)" \
  "await holder.release(req.grant.lease_id)" \
  $T/test_stalled_peers.py -k cpu-tier
mutate finish_even_if_cancelled_abandons $X/aio.py \
  "    task = asyncio.ensure_future(work)
    cancelled = False" "    return await work
    task = asyncio.ensure_future(work)
    cancelled = False" \
  $T/actor/test_parts.py -k in_flight
mutate chunk_row_index_layers_reversed $X/transports/xoscar/gpu_transfer.py \
  "return bases[rows // num_layers] + rows % num_layers" \
  "return bases[rows // num_layers] + (num_layers - 1 - rows % num_layers)" \
  $T/transports/test_contract.py -k every_bf16_bit_pattern
# Redundant with LoadRunner._holder_call's deadline: expected to pass.
mutate xoscar_transport_deadline_only $X/transports/xoscar/transport.py \
  'await with_deadline(holder("push_rows", req), self._context.rpc_timeout_s)' \
  'await holder("push_rows", req)' \
  $T/test_stalled_peers.py -k xoscar

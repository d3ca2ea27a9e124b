#!/usr/bin/env bash
# The deadline and cancellation mutations of scripts/mutate.py (its "deadlines"
# group): each one is planted in a scratch copy of the tree, and the tests meant
# to catch it run there. Expect "caught" on every line but
# xoscar_transport_deadline_only (a redundant deadline, see
# benchmark/results/reliability.md). Slow: ~15 min. Arguments go to mutate.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
exec "$py" "$root/scripts/mutate.py" --python "$py" --group deadlines "$@"

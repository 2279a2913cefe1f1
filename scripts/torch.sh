#!/usr/bin/env bash
# Install torch into the Python $1 when it has none (sourced or run by scripts/test.sh, scripts/bench.sh, .ci/run).
# torch first, and the right build: a plain `torch` requirement would pull the CUDA wheels (GBs) on any machine.
# - TORCH_SPEC set: those pip arguments (e.g. "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130").
# - an NVIDIA driver (nvidia-smi): torch==2.13.0, PyPI's CUDA build.
# - no driver: the CPU build, torch==2.13.0+cpu, from the configured indexes, else from PyTorch's CPU index.
# pyproject.toml has the tested range (2.13.0+cpu is in it: `pip install -e .` then keeps it).
set -euo pipefail
PY=${1:-python3}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if "$PY" -c "import torch" 2>/dev/null; then
  exit 0
elif [ -n "${TORCH_SPEC:-}" ]; then
  # shellcheck disable=SC2086  # pip arguments, split on purpose
  "$PY" -m pip install -q $TORCH_SPEC
elif command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
else
  echo "no NVIDIA driver here (no nvidia-smi): installing torch's CPU build (TORCH_SPEC=... to choose another)" >&2
  "$PY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || "$PY" -m pip install -q "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX"
fi

#!/usr/bin/env bash
# Install and run the default benchmark sweep: on the GPU when there is one, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first: a plain `torch` requirement would pull the CUDA wheels. TORCH_SPEC names another build (pip arguments,
# e.g. "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"); pyproject.toml has the tested range.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
$PY -m pip install -q -e .
exec $PY -m tiered_ops.cli bench "$@"

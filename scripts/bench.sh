#!/usr/bin/env bash
# Install and run the default benchmark sweep: on the GPU when there is one, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e .
exec $PY -m tiered_ops.cli bench "$@"

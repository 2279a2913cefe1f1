#!/usr/bin/env bash
# Install and run the default benchmark sweep: on the GPU when there is one, else on the CPU. A host of several GPUs
# spreads the cases over all of them, one worker process each into one store, and says so (--gpus 1 keeps to one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, its CPU build where there is no NVIDIA driver (TORCH_SPEC chooses another): scripts/torch.sh
bash scripts/torch.sh "$PY"
$PY -m pip install -q -e .
exec $PY -m tiered_ops bench "$@"

#!/usr/bin/env bash
# Install and run the test suite on a fresh machine (the README's test command; CI runs it too).
# On a machine without a GPU: Triton kernels run on the interpreter, CUDA files compile with nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, its CPU build where there is no NVIDIA driver (TORCH_SPEC chooses another): scripts/torch.sh
bash scripts/torch.sh "$PY"
$PY -m pip install -q -e ".[test,pg,hf]" -c scripts/constraints.txt  # pg: PostgreSQL store; hf: transformers
$PY -m ruff check .
set +e
# TEST_WORKERS pytest-xdist workers (default 2, CI's core count; 0: one process, as before)
$PY -m pytest -q -n "${TEST_WORKERS:-2}" tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi
exit $rc

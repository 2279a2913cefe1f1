#!/usr/bin/env bash
# Install and run the test suite on a fresh machine (the README's test command; CI runs it too).
# On a machine without a GPU: Triton kernels run on the interpreter, CUDA files compile with nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first: a plain `torch` requirement would pull the CUDA wheels.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[test]"
$PY -m ruff check .
set +e
$PY -m pytest -q tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi
exit $rc

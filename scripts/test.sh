#!/usr/bin/env bash
# Install and run the test suite on a fresh machine (the README's test command; CI runs it too).
# On a machine without a GPU: Triton kernels run on the interpreter, CUDA files compile with nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first: a plain `torch` requirement would pull the CUDA wheels. TORCH_SPEC names another build (pip arguments,
# e.g. "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"); pyproject.toml has the tested range.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
$PY -m pip install -q -e ".[test,pg,hf]"  # pg: the PostgreSQL store, tested against a real server; hf: transformers
$PY -m ruff check .
set +e
$PY -m pytest -q tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi
exit $rc

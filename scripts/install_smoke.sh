#!/usr/bin/env bash
# A plain (non-editable) install into a fresh virtual environment, used from / as a new user would: the CLI,
# python -m tiered_ops, a CPU sweep of one op and one call of each op, all against a temporary store. CI runs it.
# PYTHON picks the interpreter that makes the venv; TORCH_SPEC the torch to install first (a plain `torch` pulls the
# CUDA wheels); KEEP=1 keeps the venv and store (the path is printed).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tiered_ops_smoke.XXXXXX")
[ "${KEEP:-0}" = 1 ] && echo "work directory: $WORK" || trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }

step "venv and ${TORCH_SPEC:=torch==2.13.0}"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install -q $TORCH_SPEC  # unquoted: TORCH_SPEC may carry pip options
# The build runs in a copy of the package's folders, so it neither writes into nor picks stale files from the checkout.
step "pip install (non-editable) from a copy of $REPO"
mkdir "$WORK/src"
cp "$REPO/pyproject.toml" "$REPO/README.md" "$WORK/src/"
for pkg in tiered_ops triton_src cuda_src; do
  cp -r "$REPO/$pkg" "$WORK/src/$pkg"
done
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$V/python" -m pip install -q "$WORK/src"
rm -rf "$WORK/src"

export TIERED_OPS_DB="$WORK/store.sqlite"
cd /
step "the installed packages, not a checkout"
"$V/python" - <<'PY'
import os, sysconfig
import cuda_src, tiered_ops, triton_src
site = sysconfig.get_paths()["purelib"]
for m in (tiered_ops, triton_src, cuda_src):
    assert m.__file__.startswith(site), f"{m.__name__} imported from {m.__file__}, not from {site}"
    print(m.__name__, os.path.dirname(m.__file__))
print("cuda_src files:", sorted(f for f in os.listdir(os.path.dirname(cuda_src.__file__)) if f != "__pycache__"))
PY
step "tiered-ops list"
"$V/tiered-ops" list
step "python -m tiered_ops select softmax 64x128 --dtype fp32 --device cpu"
"$V/python" -m tiered_ops select softmax 64x128 --dtype fp32 --device cpu
step "tiered-ops bench --ops muladd --device cpu --shapes 256x1024"
"$V/tiered-ops" bench --ops muladd --device cpu --shapes 256x1024
step "one call of each op (each decides on first use, measuring into the store)"
"$V/python" - <<'PY'
import torch
import torch.nn.functional as F

import tiered_ops

g = torch.Generator().manual_seed(0)
x, w, b = torch.randn(32, 256, generator=g), torch.randn(256, generator=g), torch.randn(256, generator=g)
calls = {
    "softmax": (tiered_ops.softmax(x, dim=-1), torch.softmax(x, dim=-1)),
    "rms_norm": (tiered_ops.rms_norm(x, (256,), w), F.rms_norm(x, (256,), w)),
    "layer_norm": (tiered_ops.layer_norm(x, (256,), w, b), F.layer_norm(x, (256,), w, b)),
    "gelu": (tiered_ops.gelu(x, b, approximate="tanh"), F.gelu(x + b, approximate="tanh")),
    "muladd": (tiered_ops.muladd(x, w, b), x * w + b),
}
for op, (out, ref) in calls.items():
    torch.testing.assert_close(out, ref)
    print(f"tiered_ops.{op} matches torch")
PY
step "done"

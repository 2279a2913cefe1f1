#!/usr/bin/env bash
# Download the peers for a GPU machine without a package index (Python 3.12, manylinux x86_64); scripts/gpu.sh installs
# what it finds of them:
#   bash scripts/fetch_peers.sh           Liger-Kernel into .whl/
#   bash scripts/fetch_peers.sh --quack   also quack and the CUTLASS DSL into .whl-quack/, and the DSL's CUDA 13 library
#                                         (92 MB as a wheel) unpacked and packed again as .whl-cutlass/*.tar.xz (61 MB;
#                                         xz -9 takes minutes), and that split into three parts under
#                                         .whl-cutlass/parts/ that each travel beside the tree
#   bash scripts/fetch_peers.sh --pg      also a PostgreSQL server that travels into .whl-pg/ (15 MB): pgserver (a wheel
#                                         holding PostgreSQL's binaries) and psycopg with its binary libpq, for
#                                         scripts/gpu.sh fleet
# Not fetched: what the GPU machine's Python already has (torch, cuda-bindings, einops, protobuf, typing-extensions).
set -euo pipefail
cd "$(dirname "$0")/.."
dl() {
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "$@"
}
dl .whl liger-kernel==0.8.5
if [ "${1:-}" = --pg ]; then
  dl .whl-pg pgserver==0.1.4 psycopg==3.3.9 psycopg-binary==3.3.9
fi
if [ "${1:-}" = --quack ]; then
  dl .whl-quack quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
  tmp=$(mktemp -d)
  dl "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
  mkdir -p "$tmp/tree" .whl-cutlass
  python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/tree"
  tar cf - -C "$tmp/tree" . | xz -9 -T0 > .whl-cutlass/nvidia_cutlass_dsl_libs_cu13-4.8.1.tar.xz
  rm -rf "$tmp"
  # three parts of about 21 MB: each travels beside the tree (39 MB), one a call (scripts/gpu.sh peers)
  rm -rf .whl-cutlass/parts && mkdir -p .whl-cutlass/parts
  for k in 0 1 2; do
    split -n "$((k + 1))/3" .whl-cutlass/nvidia_cutlass_dsl_libs_cu13-4.8.1.tar.xz \
      > ".whl-cutlass/parts/nvidia_cutlass_dsl_libs_cu13-4.8.1.tar.xz.$k-of-3"
  done
fi
ls -la .whl .whl-quack .whl-cutlass .whl-pg 2>/dev/null || true

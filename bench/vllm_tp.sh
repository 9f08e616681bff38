#!/usr/bin/env bash
# The vLLM plugin in a vLLM of tensor-parallel size 2 against one of size 1,
# same model, same run (bench/vllm_tp.py): sync time through vLLM's routes
# over shm and tcp, and each rank's staged bytes at their peak against the
# model's. Usage: bench/vllm_tp.sh [LAYERS (default 16)] [SYNCS (default 4)]
# Needs the vLLM venv (scripts/setup.sh): .venv-vllm, or WTX_VLLM_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
layers=${1:-16} syncs=${2:-4}
py=${WTX_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}
bazel build -c opt //lib:libwtx.so //server:wtx-worker 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The package as tests/python/pkg_env.sh assembles it (entry points
# included, for vLLM's plugin loader), with the optimised libwtx.so.
TEST_TMPDIR=$tmp py_var=WTX_VLLM_PYTHON py_reqs=tests/python/vllm-requirements.txt \
  py_imports="vllm, grpc_tools, xxhash" py=$py . tests/python/pkg_env.sh
export WTX_LIBWTX="$bin/lib/libwtx.so" WTX_WORKER="$bin/server/wtx-worker" VLLM_TARGET_DEVICE=cpu
PYTHONPATH="$PYTHONPATH:$PWD/bench" "$py" bench/vllm_tp.py "$layers" "$syncs"

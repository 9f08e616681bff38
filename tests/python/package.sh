#!/usr/bin/env bash
# Bazel sh_test wrapper of the Python package's tests (package_test.py):
# the package as pkg_env.sh prepares it, run with the Python environment
# scripts/setup.sh prepares (WTX_PYTHON: torch, transformers, grpcio).
set -euo pipefail
py="${WTX_PYTHON:-}"
if [ -z "$py" ] || ! "$py" -c "import grpc, grpc_tools, torch, transformers" 2>/dev/null; then
  echo "FAIL: WTX_PYTHON must name a Python with tests/python/requirements.txt" >&2
  exit 1
fi
. tests/python/pkg_env.sh
export WTX_ABI_PROBE="$PWD/tests/python/abi_probe"
exec "$py" tests/python/package_test.py "$@"

#!/usr/bin/env bash
# Bazel sh_test wrapper of the Python package's tests (package_test.py):
# the package as pkg_env.sh prepares it, run with the Python environment
# scripts/setup.sh prepares (WTX_PYTHON: torch, transformers, grpcio).
set -euo pipefail
py="${WTX_PYTHON:-}" py_var=WTX_PYTHON py_reqs=tests/python/requirements.txt
py_imports="grpc, grpc_tools, torch, transformers"
. tests/python/pkg_env.sh
export WTX_ABI_PROBE="$PWD/tests/python/abi_probe"
exec "$py" tests/python/package_test.py "$@"

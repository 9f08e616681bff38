#!/usr/bin/env bash
# Bazel sh_test wrapper of the vLLM tests (vllm_test.py, or the script
# named first): the package as pkg_env.sh prepares it, run with the vLLM
# venv scripts/setup.sh prepares (WTX_VLLM_PYTHON: vllm 0.33 from PyPI).
set -euo pipefail
py="${WTX_VLLM_PYTHON:-}" py_var=WTX_VLLM_PYTHON py_reqs=tests/python/vllm-requirements.txt
py_imports="vllm, grpc_tools, xxhash"
. tests/python/pkg_env.sh
export VLLM_TARGET_DEVICE=cpu
script=${1:-vllm_test.py}
[ $# -gt 0 ] && shift
exec "$py" "tests/python/$script" "$@"

#!/usr/bin/env bash
# Bazel sh_test wrapper: runs worker_test.py with the Python environment that
# scripts/setup.sh prepares (WTX_PYTHON, passed with --test_env).
set -euo pipefail
py="${WTX_PYTHON:-}"
if [ -z "$py" ] || ! "$py" -c "import grpc, grpc_tools, safetensors, xxhash" 2>/dev/null; then
  echo "FAIL: WTX_PYTHON must name a Python with tests/python/requirements.txt" >&2
  echo "      installed (scripts/setup.sh makes .venv; scripts/test.sh passes it)" >&2
  exit 1
fi
export WTX_WORKER="$PWD/server/wtx-worker"
export WTX_CLI="$PWD/client/wtx"
export WTX_PROTO_ROOT="$PWD/proto"
export WTX_FAKE_CUDA="$PWD/cuda/testing/libwtx_fake_cuda.so"
exec "$py" "tests/python/${1:-worker_test.py}"

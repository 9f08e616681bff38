#!/usr/bin/env bash
# Builds the GPU bundle here, for a GPU machine that has no Bazel, no apt
# and no network (the device tool's): opt binaries of the worker, the CLI,
# the GPU test and the seam probe, with their shared-library closure, in one
# folder of about 20 MB. On the GPU machine: tests/gpu/bundle/device_check.sh
# Usage: tests/gpu/bundle.sh [OUT]   (default tests/gpu/bundle, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-tests/gpu/bundle}
targets=(//server:wtx-worker //client:wtx //tests/gpu:gpu_test //tests/gpu:probe
         //bench:memcpy_baseline //bench:socket_baseline //tests/client:gpu_model_worker
         //cuda/testing:libwtx_fake_cuda.so //lib:libwtx.so)
bazel build -c opt "${targets[@]}" 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
tests/gpu/assemble.sh "$out" "$bin/server/wtx-worker" "$bin/client/wtx" \
  "$bin/tests/gpu/gpu_test" "$bin/tests/gpu/probe" "$bin/bench/memcpy_baseline" \
  "$bin/bench/socket_baseline" "$bin/tests/client/gpu_model_worker" "$bin/cuda/testing/libwtx_fake_cuda.so" "$bin/lib/libwtx.so" .venv/bin/python

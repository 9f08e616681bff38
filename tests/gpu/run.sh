#!/usr/bin/env bash
# Builds and runs the GPU tests on the real CUDA runtime and NCCL, on a
# machine with an NVIDIA GPU (under 8 minutes). One GPU: cuda_ipc between
# processes on that GPU; nccl needs a GPU per rank and reports SKIPPED with
# the reason. Without a GPU every test reports SKIPPED, never passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
scripts/setup.sh >/dev/null || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi -L
bazel test -c opt --test_output=all //tests/gpu:gpu_test 2>&1 |
  grep -E '^\[|PASSED|FAILED|SKIPPED|Skipped|ERROR|error'
rc=${PIPESTATUS[0]}
log=bazel-testlogs/tests/gpu/gpu_test/test.log
ran=$(grep -cE '^\[       OK \] .*\([0-9]+ ms\)' "$log" || true)
skipped=$(grep -cE '^\[  SKIPPED \] .*\([0-9]+ ms\)' "$log" || true)
failed=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)' "$log" || true)
echo "gpu tests: ${ran} passed, ${failed} failed, ${skipped} skipped"
exit $rc

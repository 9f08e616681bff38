#!/usr/bin/env bash
# The GPU bundle proven here, end to end, against the CUDA/NCCL TEST DOUBLE:
# assembled from the binaries this build made (as tests/gpu/bundle.sh does
# with opt ones), moved away from the build tree, and run by
# device_check.sh --double exactly as on a GPU machine. Every step must
# PASS; the size must stay within what the device tool carries (64 MiB).
set -euo pipefail
tmp=${TEST_TMPDIR:-$(mktemp -d)}
out=$tmp/bundle
tests/gpu/assemble.sh "$out" server/wtx-worker client/wtx tests/gpu/gpu_test tests/gpu/probe \
  bench/memcpy_baseline bench/socket_baseline tests/client/gpu_model_worker cuda/testing/libwtx_fake_cuda.so
size=$(du -sm "$out" | cut -f1)
echo "bundle: ${size} MiB"
[ "$size" -le 60 ] || { echo "FAIL: the bundle is ${size} MiB, over 60"; exit 1; }
mv "$out" "$tmp/elsewhere"  # nothing may point back into the build tree
cd "$tmp/elsewhere"
env -u WTX_CUDART_LIB -u WTX_NCCL_LIB OUT="$tmp/out" ./device_check.sh --double
summary=$tmp/out/device_check/summary.log
grep -q "^device check: 8 passed, 0 failed, 0 skipped" "$summary" ||
  { echo "FAIL: not every step passed"; exit 1; }

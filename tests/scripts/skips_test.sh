#!/usr/bin/env bash
# scripts/test.sh's closing summary as CI reads it: every skipped case named
# with its reason (GoogleTest's and Python unittest's, in targets where
# other cases passed too), targets whose every case skipped counted apart,
# and only the logs of targets the pass ran. A STAND-IN bazel on PATH
# answers both passes from prepared test logs; scripts/setup.sh is a no-op
# here.
set -euo pipefail
root=${TEST_TMPDIR:-$(mktemp -d)}/root
mkdir -p "$root/scripts" "$root/bin"
cp scripts/test.sh scripts/skips.sh "$root/scripts/"
printf '#!/bin/sh\nexit 0\n' >"$root/scripts/setup.sh"
cat >"$root/bin/bazel" <<'EOF'
#!/usr/bin/env bash
case " $* " in
  *" --config=asan "*)
    echo "//tests/a:mixed_test                                 FAILED in 0.2s"
    echo "//tests/gpu:gpu_test                                 PASSED in 0.1s"
    exit 3 ;;
  *)
    echo "INFO: Found 5 test targets..."
    echo "//tests/a:mixed_test                                 PASSED in 0.1s"
    echo "//tests/a:ok_test                           (cached) PASSED in 0.1s"
    echo "//tests/gpu:gpu_test                                 PASSED in 0.1s"
    echo "//tests/p:py_test                                    PASSED in 0.3s" ;;
esac
EOF
chmod +x "$root/scripts/setup.sh" "$root/bin/bazel"
logs=$root/bazel-testlogs
log() { mkdir -p "$logs/$1" && cat >"$logs/$1/test.log"; }

log tests/a/mixed_test <<'EOF'
[==========] Running 3 tests from 1 test suite.
[ RUN      ] ShmTest.Reads
[       OK ] ShmTest.Reads (1 ms)
[ RUN      ] ShmTest.NeedsRoot
tests/transport/shm_test.cc:143: Skipped
needs root to give a region to another user
[  SKIPPED ] ShmTest.NeedsRoot (0 ms)
[ RUN      ] ShmTest.Bare
tests/transport/shm_test.cc:150: Skipped

[  SKIPPED ] ShmTest.Bare (0 ms)
[==========] 3 tests from 1 test suite ran. (1 ms total)
[  PASSED  ] 1 test.
[  SKIPPED ] 2 tests, listed below:
[  SKIPPED ] ShmTest.NeedsRoot
[  SKIPPED ] ShmTest.Bare
EOF
log tests/a/ok_test <<'EOF'
[ RUN      ] Ok.Works
[       OK ] Ok.Works (0 ms)
[  PASSED  ] 1 test.
EOF
log tests/gpu/gpu_test <<'EOF'
[ RUN      ] RealCuda/GpuTest.Pushes/cuda_ipc
tests/gpu/gpu_test.cc:58: Skipped
no NVIDIA GPU visible to the CUDA runtime
[  SKIPPED ] RealCuda/GpuTest.Pushes/cuda_ipc (2 ms)
[ RUN      ] RealCuda/GpuTest.Pushes/nccl
tests/gpu/gpu_test.cc:58: Skipped
no NVIDIA GPU visible to the CUDA runtime
[  SKIPPED ] RealCuda/GpuTest.Pushes/nccl (5 ms)
[  PASSED  ] 0 tests.
[  SKIPPED ] 2 tests, listed below:
[  SKIPPED ] RealCuda/GpuTest.Pushes/cuda_ipc
[  SKIPPED ] RealCuda/GpuTest.Pushes/nccl
EOF
# Python 3.11's unittest, verbosity=2: a test's own output splits a line,
# a docstring moves the result to the next one, a class skips in setUpClass.
log tests/p/py_test <<'EOF'
test_a (__main__.T.test_a) ... ok
test_b (__main__.T.test_b) ... skipped 'needs vllm'
test_c (__main__.T.test_c) ... I1205 07:42:30 chttp2_transport.cc:1403] Got goaway
skipped "the worker's GPU is gone"
test_d (__main__.T.test_d)
A docstring line. ... skipped 'no torch'
setUpClass (__main__.U) ... skipped 'no openssl'

----------------------------------------------------------------------
Ran 4 tests in 0.000s

OK (skipped=4)
EOF
# A target this run did not run: its old log is not counted.
log tests/a/stale_test <<'EOF'
[ RUN      ] Old.Case
tests/a/stale_test.cc:1: Skipped
from an earlier run
[  SKIPPED ] Old.Case (0 ms)
[  PASSED  ] 0 tests.
EOF

set +e
out=$(PATH="$root/bin:$PATH" "$root/scripts/test.sh" 2>&1)
rc=$?
set -e
want='tests: 3 passed, 1 failed, 2 skipped (targets); 12 cases skipped
  skipped (plain): //tests/a:mixed_test ShmTest.NeedsRoot: needs root to give a region to another user
  skipped (plain): //tests/a:mixed_test ShmTest.Bare: (no reason given)
  skipped (plain): //tests/gpu:gpu_test RealCuda/GpuTest.Pushes/cuda_ipc: no NVIDIA GPU visible to the CUDA runtime
  skipped (plain): //tests/gpu:gpu_test RealCuda/GpuTest.Pushes/nccl: no NVIDIA GPU visible to the CUDA runtime
  skipped (plain): //tests/p:py_test __main__.T.test_b: needs vllm
  skipped (plain): //tests/p:py_test __main__.T.test_c: the worker'"'"'s GPU is gone
  skipped (plain): //tests/p:py_test __main__.T.test_d: no torch
  skipped (plain): //tests/p:py_test __main__.U.setUpClass: no openssl
  skipped (asan): //tests/a:mixed_test ShmTest.NeedsRoot: needs root to give a region to another user
  skipped (asan): //tests/a:mixed_test ShmTest.Bare: (no reason given)
  skipped (asan): //tests/gpu:gpu_test RealCuda/GpuTest.Pushes/cuda_ipc: no NVIDIA GPU visible to the CUDA runtime
  skipped (asan): //tests/gpu:gpu_test RealCuda/GpuTest.Pushes/nccl: no NVIDIA GPU visible to the CUDA runtime'
got=$(printf '%s\n' "$out" | sed -n '/^tests: /,$p')
if [ "$got" != "$want" ]; then
  echo "FAIL: the summary differs (want, got):"
  diff <(echo "$want") <(echo "$got") || true
  echo "--- whole output:"
  echo "$out"
  exit 1
fi
if [ "$rc" -ne 3 ]; then
  echo "FAIL: test.sh exited $rc, not the failing pass's 3"
  exit 1
fi
echo "PASS"

#!/usr/bin/env bash
# README command 2: sets up a fresh Debian 12 machine, then builds and runs the
# whole suite twice: plain, and under AddressSanitizer + UBSan.
# Usage: scripts/test.sh [extra bazel test args]
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

log=$(mktemp)
status=0
for config in "" "--config=asan --test_tag_filters=-fuzz,-noasan"; do
  # The fuzz targets carry their own sanitizers, and the GPU bundle test
  # checks packaging: the plain pass runs them.
  echo "== bazel test //... ${config:-(plain)}"
  bazel test ${config} --test_summary=short \
    --test_env=WTX_PYTHON="$PWD/.venv/bin/python" \
    --test_env=WTX_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" //... "$@" 2>&1 | tee -a "$log" |
    grep -vE '^(Loading|Analyzing|\[[0-9,]+ / [0-9,]+\]|INFO: (Analyzed|Found))'
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=$rc
  # Bazel 4 has no "skipped": a GoogleTest target whose every case skipped
  # (the GPU tests without a GPU) says PASSED. Count it as skipped, with why.
  for t in $(find -L bazel-testlogs -name test.log 2>/dev/null); do
    if grep -qE '^\[  PASSED  \] 0 tests' "$t" && grep -qE '^\[  SKIPPED \]' "$t"; then
      echo "SKIPPED_TARGET ${t#bazel-testlogs/}" >>"$log"
      echo "  skipped: ${t#bazel-testlogs/}: $(grep -m1 -A1 ': Skipped$' "$t" | tail -1)"
    fi
  done
done

skipped=$(grep -c '^SKIPPED_TARGET' "$log")
passed=$(( $(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log") - skipped ))
failed=$(grep -cE '^//\S+\s+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log")
rm -f "$log"
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit $status

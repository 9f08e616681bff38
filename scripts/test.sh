#!/usr/bin/env bash
# README command 2: sets up a fresh Debian 12 machine, then builds and runs the
# whole suite twice: plain, and under AddressSanitizer + UBSan.
# Usage: scripts/test.sh [extra bazel test args]
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

log=$(mktemp)
status=0
for config in "" "--config=asan"; do
  echo "== bazel test //... ${config:-(plain)}"
  bazel test ${config} --test_summary=short \
    --test_env=WTX_PYTHON="$PWD/.venv/bin/python" //... "$@" 2>&1 | tee -a "$log" |
    grep -vE '^(Loading|Analyzing|\[[0-9,]+ / [0-9,]+\]|INFO: (Analyzed|Found))'
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=$rc
done

passed=$(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//\S+\s+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log")
skipped=$(grep -cE '^//\S+\s+.*SKIPPED' "$log")
rm -f "$log"
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit $status

#!/usr/bin/env bash
# README command 2: sets up a fresh Debian 12 machine, then builds and runs the
# whole suite twice: plain, and under AddressSanitizer + UBSan.
# Usage: scripts/test.sh [extra bazel test args]
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

log=$(mktemp)
pass_log=$(mktemp)
skips=$(mktemp)
status=0
for config in "" "--config=asan --test_tag_filters=-fuzz,-noasan"; do
  # The fuzz targets carry their own sanitizers, and the GPU bundle test
  # checks packaging: the plain pass runs them.
  pass=${config:+asan}
  echo "== bazel test //... ${config:-(plain)}"
  bazel test ${config} --test_summary=short \
    --test_env=WTX_PYTHON="$PWD/.venv/bin/python" \
    --test_env=WTX_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" //... "$@" 2>&1 | tee "$pass_log" |
    grep -vE '^(Loading|Analyzing|\[[0-9,]+ / [0-9,]+\]|INFO: (Analyzed|Found))'
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=$rc
  cat "$pass_log" >>"$log"
  # Bazel 4 has no "skipped": a target whose cases skipped says PASSED.
  # scripts/skips.sh names every skipped case, with why, from the logs of
  # the targets this pass ran (bazel-testlogs also keeps older ones).
  logs=()
  for t in $(awk '/^\/\/[^ ]+ +(\(cached\) )?(PASSED|FAILED|FLAKY|TIMEOUT|NO STATUS|INCOMPLETE)/ {
                   print $1 }' "$pass_log" | sort -u); do
    t=${t#//}
    [ -f "bazel-testlogs/${t/://}/test.log" ] && logs+=("bazel-testlogs/${t/://}/test.log")
  done
  [ ${#logs[@]} -eq 0 ] || scripts/skips.sh "${logs[@]}" | sed "s/^/${pass:-plain}\t/" >>"$skips"
done

skipped=$(awk -F'\t' '$2 == "target"' "$skips" | wc -l)
cases=$(awk -F'\t' '$2 == "case"' "$skips" | wc -l)
passed=$(( $(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log") - skipped ))
failed=$(grep -cE '^//\S+\s+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log")
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped (targets); ${cases} cases skipped"
awk -F'\t' '$2 == "case" { printf "  skipped (%s): %s %s: %s\n", $1, $3, $4, $5 }' "$skips"
rm -f "$log" "$pass_log" "$skips"
exit $status

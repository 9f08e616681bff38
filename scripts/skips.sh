#!/usr/bin/env bash
# Every skipped test case in Bazel test logs, with its reason. Bazel 4 has
# no "skipped": a target whose cases skipped says PASSED, so a case that
# stopped running (a lost GPU, a kernel feature, a missing tool) would go
# unnoticed unless each one is named.
#
# Usage: scripts/skips.sh LOG...   (LOG: bazel-testlogs/<package>/<name>/test.log)
#
# Reads GoogleTest's "[  SKIPPED ] Suite.Case (N ms)", whose reason is the
# line under "<file>:<line>: Skipped", and Python unittest's verbose
# "test_x (module.Class.test_x) ... skipped 'reason'", also when the
# test's own output split that line. Prints, tab-separated:
#   case    //package:name    Suite.Case    reason     one per skipped case
#   target  //package:name                             one per target whose
#                                                      every case skipped
set -euo pipefail

read -r -d '' program <<'AWK' || true
function emit(name, why) {
  if (why == "") why = "(no reason given)"
  printf "case\t%s\t%s\t%s\n", target, name, why
}
# GoogleTest: the reason is the first line after "file:line: Skipped".
/^\[ RUN      \] / { reason = ""; grab = 0; next }
/: Skipped$/ { grab = 1; reason = ""; next }
grab && !/^\[  SKIPPED \] / { reason = $0; grab = 0; next }
/^\[  SKIPPED \] .* \([0-9]+ ms\)$/ {
  name = $0
  sub(/^\[  SKIPPED \] /, "", name)
  sub(/ \([0-9]+ ms\)$/, "", name)
  emit(name, reason)
  gt_skipped++; reason = ""; grab = 0
  next
}
/^\[  PASSED  \] [0-9]+ tests?\.$/ { gt_seen = 1; gt_passed += $4 }
/^\[  FAILED  \] [0-9]+ tests?, listed below:$/ { gt_failed = 1 }
# unittest: "name (id)" opens a case (" ... result" follows on that line,
# or on a later one when a docstring or the test's output came between).
/^(test[A-Za-z0-9_]*|setUpClass|tearDownClass|setUpModule|tearDownModule) \([^ ()]+\)/ {
  fn = $1
  id = $2
  gsub(/[()]/, "", id)
  n = length(fn)
  # Python 3.11 writes the whole id (module.Class.test_x); older ones
  # write module.Class.
  current = substr(id, length(id) - n + 1) == fn && length(id) > n ? id : id "." fn
}
/(^|\.\.\. )skipped ['"]/ {
  p = index($0, "... skipped ")
  why = p > 0 ? substr($0, p + 12) : substr($0, 9)
  if (length(why) >= 2) why = substr(why, 2, length(why) - 2)  # the repr's quotes
  emit(current == "" ? "(unnamed case)" : current, why)
  py_found++
  # A class or module skipped in its setUp counts as a skip, not as a run.
  if (current ~ /\.(setUpClass|setUpModule)$/) py_unrun++
}
/^Ran [0-9]+ tests? in / { py_ran += $2 }
/^(OK|FAILED) \(.*skipped=[0-9]+/ {
  k = $0
  sub(/^.*skipped=/, "", k)
  sub(/[^0-9].*$/, "", k)
  k += 0
  py_skipped += k
  # Quiet unittest (no verbosity=2) prints an "s" per skip and no names.
  if (k > py_found) emit((k - py_found) " case(s)", "unnamed: run unittest with verbosity=2 to see which and why")
  py_found = 0
}
END {
  if ((gt_seen && gt_passed == 0 && gt_skipped > 0 && !gt_failed) ||
      (py_ran > 0 && py_skipped - py_unrun == py_ran))
    printf "target\t%s\n", target
}
AWK

for log in "$@"; do
  rel=${log#*testlogs/}
  rel=${rel%/test.log}
  awk -v target="//${rel%/*}:${rel##*/}" "$program" "$log"
done

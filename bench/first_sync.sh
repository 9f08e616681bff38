#!/usr/bin/env bash
# A trainer's first sync to a new worker, where the worker builds its tables
# in memory it has never touched: for ROUNDS fresh workers (one push each)
# the sync's seconds, the page faults the worker took during it
# (/proc/PID/stat), and the time its update and prepare handlers took (its
# --metrics-listen histogram; with calls ahead of their turn an update's
# time includes its wait for the call before it); then each figure's
# median, and what a page fault costs here (bench/pagefault_baseline). The
# first-sync fault counts and fault costs of bench/results/*.md come from
# this.
# Usage: bench/first_sync.sh [--at REV] [--tiny N] [--rounds R] [--restarts]
#                           [--env VAR=VALUE]...
#   --at REV: the worker and wtx of commit REV (built in a worktree), not
#             the working tree's
#   --tiny N: N tiny tensors (default 40000, bench/tiny_model.py)
#   --restarts: one worker for every round, which has served once before
#             the first (a trainer that restarts against it: each round a
#             new wtx push process, a new session, its first sync)
#   --env: set in each worker's environment (e.g. GLIBC_TUNABLES=...)
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=40000 rounds=7 envs=() at= restarts=
while [ $# -gt 0 ]; do
  case $1 in
    --restarts) restarts=1; shift ;;
    --tiny) tiny=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --at) at=$2; shift 2 ;;
    *) echo "bench/first_sync.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
bazel build -c opt //server:wtx-worker //client:wtx //bench:pagefault_baseline 2>&1 |
  grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
base=$bin # pagefault_baseline: this tree's
scripts/setup.sh >/dev/null
tmp=$(mktemp -d)
wp=
trap '[ -n "$wp" ] && kill "$wp" 2>/dev/null; wait 2>/dev/null
      [ -d "$tmp/src" ] && (cd "$tmp/src" && bazel shutdown 2>/dev/null)
      git worktree remove --force "$tmp/src" 2>/dev/null || true; rm -rf "$tmp"' EXIT
if [ -n "$at" ]; then
  git worktree add -q --detach "$tmp/src" "$at"
  (cd "$tmp/src" && bazel build -c opt //server:wtx-worker //client:wtx 2>&1 |
     grep -E '^(ERROR|FAILED)' && exit 1; true)
  bin=$(cd "$tmp/src" && bazel info -c opt bazel-bin 2>/dev/null)
fi
.venv/bin/python bench/tiny_model.py "$tiny" "$tmp/tiny.safetensors"
port() { .venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
# handler_ms OP: the worker's seconds in OP's handler so far, in ms
handler_ms() {
  curl -s "127.0.0.1:$mport/metrics" | awk -v op="$1" -F'[ ]' \
    '$1 == "wtx_rl_weight_update_operation_duration_seconds_sum{operation=\"" op "\"}" {printf "%.1f", $2 * 1000}'
}
# start_worker: a fresh worker (wp, mport, its port in $tmp/port)
start_worker() {
  mport=$(port)
  rm -f "$tmp/port"
  env ${envs[@]+"${envs[@]}"} "$bin/server/wtx-worker" --listen 127.0.0.1:0 \
    --port-file "$tmp/port" --log-level warn --metrics-listen "127.0.0.1:$mport" &
  wp=$!
  for _ in $(seq 500); do [ -s "$tmp/port" ] && break; sleep 0.01; done
}
push() {
  "$bin/client/wtx" push --workers "127.0.0.1:$(cat "$tmp/port")" --buffer-size 64M \
    "$tmp/tiny.safetensors" | sed -nE 's/.* in ([0-9.e-]+) s .*/\1/p'
}
if [ -n "$restarts" ]; then
  echo "# first sync of $tiny tiny tensors from a restarted trainer to a worker that served before (shm), $rounds trainers, ${at:-the working tree}${envs:+; worker env: ${envs[*]}}"
  start_worker
  push >/dev/null # the worker's own first sync
else
  echo "# first sync of $tiny tiny tensors to a fresh worker (shm), $rounds workers, ${at:-the working tree}${envs:+; worker env: ${envs[*]}}"
fi
printf "%-8s %10s %12s %12s %12s\n" run "sync s" "page faults" "update ms" "prepare ms"
for r in $(seq "$rounds"); do
  [ -n "$restarts" ] || start_worker
  f0=$(awk '{print $10}' /proc/$wp/stat)
  u0=$(handler_ms update) p0=$(handler_ms prepare)
  s=$(push)
  f1=$(awk '{print $10}' /proc/$wp/stat)
  printf "%-8s %10s %12s %12.1f %12.1f\n" "$r" "$s" "$((f1 - f0))" \
    "$(echo "$(handler_ms update) - ${u0:-0}" | bc)" "$(echo "$(handler_ms prepare) - ${p0:-0}" | bc)" |
    tee -a "$tmp/rows"
  [ -n "$restarts" ] || { kill "$wp"; wait "$wp" 2>/dev/null || true; wp=; }
done
python3 - "$tmp/rows" <<'PY'
import statistics, sys
cols = list(zip(*(l.split()[1:] for l in open(sys.argv[1]))))
m = [statistics.median(float(x) for x in c) for c in cols]
print(f"{'median':<8} {m[0]:10.4g} {m[1]:12.0f} {m[2]:12.1f} {m[3]:12.1f}")
PY
"$base/bench/pagefault_baseline" | sed 's/^/# this machine: /'

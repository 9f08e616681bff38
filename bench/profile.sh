#!/usr/bin/env bash
# Where a steady-state sync spends its time: builds -c opt with frame
# pointers, warms one worker up (four syncs), then records syncs with
# perf on the worker and the trainer and prints each one's top symbols and
# CPU seconds, and the worker's time in each call's handler per sync (from
# its --metrics-listen histogram). The "where the time goes" sections of bench/results/*.md
# come from this.
# Usage: bench/profile.sh [--backend shm|tcp] [--tiny N | --size 1G]
#                         [--syncs N | --first] [--trainer-syncs M] [--hz F]
#                         [-- extra wtx push flags]
#   --tiny N: N tiny tensors (bench/tiny_model.py), the control plane
#   --syncs N: the worker is recorded over N syncs (default 1), the trainer
#              over the last; --hz F: samples per second (default 5000)
#   --trainer-syncs M: that last push makes M syncs from one trainer (wtx
#              push --repeat M), a training loop's steady state, and the
#              trainer's section also gives the CPU of its sync loop (the
#              calling thread's, its process start left out) per sync; the
#              worker's section counts them with the others
#   --first: the first sync to a fresh worker instead (no warm-up; one sync)
#   PROFILE_TOP=N in the environment: symbols printed per side (default 15)
#   PROFILE_KEEP=DIR: perf's data is kept there (worker.data, trainer.data),
#              for perf report --children and the call graphs
set -euo pipefail
cd "$(dirname "$0")/.."
backend=shm size=1G tiny= syncs=1 tsyncs=1 hz=5000 first= extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --backend) backend=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --tiny) tiny=$2; shift 2 ;;
    --syncs) syncs=$2; shift 2 ;;
    --trainer-syncs) tsyncs=$2; shift 2 ;;
    --hz) hz=$2; shift 2 ;;
    --first) first=1; syncs=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "bench/profile.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "$first" ] && [ "$tsyncs" != 1 ]; then
  echo "bench/profile.sh: --first profiles one sync; --trainer-syncs is for the steady state" >&2
  exit 2
fi
command -v perf >/dev/null || { echo "bench/profile.sh: needs perf (linux-perf)" >&2; exit 1; }
scripts/setup.sh >/dev/null
opt=(-c opt --copt=-fno-omit-frame-pointer)
bazel build "${opt[@]}" //server:wtx-worker //client:wtx 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info "${opt[@]}" bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
trap 'kill "$wp" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT
model="synthetic:$size"
if [ -n "$tiny" ]; then
  .venv/bin/python bench/tiny_model.py "$tiny" "$tmp/tiny.safetensors"
  model="$tmp/tiny.safetensors"
fi
mport=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/port" --log-level warn \
  --metrics-listen "127.0.0.1:$mport" &
wp=$!
# The worker's own time per operation (its Prometheus histogram's sums).
op_sums() {
  curl -s "127.0.0.1:$mport/metrics" |
    sed -n 's/^wtx_rl_weight_update_operation_duration_seconds_sum{operation="\(.*\)"} /\1 /p'
}
for _ in $(seq 500); do [ -s "$tmp/port" ] && break; sleep 0.01; done
push=("$bin/client/wtx" push --workers "127.0.0.1:$(cat "$tmp/port")" --backend "$backend"
      "${extra[@]}" "$model")
[ -n "$first" ] || for _ in 1 2 3 4; do "${push[@]}" >/dev/null; done
op_sums >"$tmp/ops.before"
perf record -F "$hz" -g -p "$wp" -o "$tmp/worker.data" 2>/dev/null &
pp=$!
sleep 0.5
for _ in $(seq $((syncs - 1))); do "${push[@]}" | head -1; done
perf record -F "$hz" -g -o "$tmp/trainer.data" "${push[@]}" --repeat "$tsyncs" 2>/dev/null |
  tail -1 # reads to the end: no SIGPIPE for the push
recorded=$((syncs - 1 + tsyncs)) # the syncs the worker's recording saw
sleep 0.2
kill -INT "$pp"
wait "$pp" 2>/dev/null || true
op_sums >"$tmp/ops.after"
echo "== worker: time in each operation's handler per sync (its metrics)"
join <(sort "$tmp/ops.before") <(sort "$tmp/ops.after") |
  awk -v n="$recorded" '$3 > $2 { printf "    %-12s %.5f s\n", $1, ($3 - $2) / n }'
for side in worker trainer; do
  n=$(perf script -i "$tmp/$side.data" 2>/dev/null | grep -c cpu-clock || true)
  if [ "$side" = worker ]; then
    echo "== worker: $n samples at $hz Hz over $recorded sync(s) =" \
      "$(echo "$n / $hz / $recorded" | bc -l | xargs printf '%.4f') s of CPU per sync"
  else
    echo "== trainer (the last push, process start to exit): $n samples at $hz Hz =" \
      "$(echo "$n / $hz" | bc -l | xargs printf '%.3f') s of CPU"
    loop=
    [ "$tsyncs" -gt 1 ] && loop=$(perf report -i "$tmp/trainer.data" --children --stdio \
      --sort sym 2>/dev/null |
      awk '$NF == "push_sync" && $1 ~ /%$/ && !done { sub("%", "", $1); print $1; done = 1 }')
    [ -n "$loop" ] &&
      echo "   its sync loop on the calling thread (push_sync; threads of its backend, as tcp's writer, not counted): $(echo "$loop / 100 * $n / $hz / $tsyncs" |
        bc -l | xargs printf '%.4f') s of CPU per sync over its $tsyncs syncs"
  fi
  perf report -i "$tmp/$side.data" --no-children --stdio --sort sym 2>/dev/null |
    grep -E '^ +[0-9]' | awk "NR <= ${PROFILE_TOP:-15}" # reads to the end: no SIGPIPE under pipefail
done
if [ -n "${PROFILE_KEEP:-}" ]; then
  mkdir -p "$PROFILE_KEEP"
  cp "$tmp/worker.data" "$tmp/trainer.data" "$PROFILE_KEEP/"
fi

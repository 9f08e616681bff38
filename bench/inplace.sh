#!/usr/bin/env bash
# One copy per byte over shm with many senders: 4 trainer ranks (FSDP, dim 0
# of every tensor split over them; wtx push --world 4, a process per rank)
# sync one synthetic model to one worker whose model loads as an engine's
# loader does, copying each tensor into its own parameters at commit
# (bench/loader_worker). Two ways, alternated ROUNDS times, each a fresh
# worker and fresh ranks making three syncs (the third measured, rank 0's
# wall time, which answers for the sync):
#   rings     the model stages: each rank copies into its ring, the worker
#             out of it into staging, the loader into its parameters
#   in place  the model reads where the bytes land (adopt_chunk): each rank
#             copies into the worker's receive region, the worker hashes
#             it there, the loader copies it into its parameters
# Also each worker's peak resident memory (VmHWM) over the three syncs.
# Usage: bench/inplace.sh [SIZE] [ROUNDS]   (default 1G 3)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1G}
rounds=${2:-3}
. bench/lib.sh
bazel build -c opt //client:wtx //bench:loader_worker 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
wp=
trap '[ -n "$wp" ] && kill "$wp" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT
export WTX_SESSION_TOKEN=bench-inplace-session-token-01
# one WAY FLAG: a fresh worker and 4 fresh ranks; prints the third sync's
# seconds and the worker's VmHWM in MiB.
one() {
  rm -f "$tmp/port"
  "$bin/bench/loader_worker" --listen 127.0.0.1:0 --port-file "$tmp/port" $2 2>"$tmp/w.log" &
  wp=$!
  for _ in $(seq 500); do [ -s "$tmp/port" ] && break; sleep 0.01; done
  local ranks="" rpids=()
  for r in 0 1 2 3; do ranks+="${ranks:+,}127.0.0.1:$(free_port)"; done
  for r in 0 1 2 3; do
    "$bin/client/wtx" push --workers "127.0.0.1:$(cat "$tmp/port")" --backend shm --world 4 \
      --rank "$r" --rank-addresses "$ranks" --repeat 3 "synthetic:$size" >"$tmp/$1$r.out" &
    rpids+=($!)
  done
  for p in "${rpids[@]}"; do wait "$p"; done
  local s hwm
  s=$(sed -nE 's/.* in ([0-9.e-]+) s .*/\1/p' "$tmp/${1}0.out" | tail -1)
  hwm=$(awk '/VmHWM/ {printf "%.0f", $2 / 1024}' /proc/$wp/status)
  kill "$wp"; wait "$wp" 2>/dev/null || true; wp=
  echo "$s $hwm"
}
echo "# 4 ranks to one loader over shm  $(date -u +%F)  $(nproc) cores  synthetic:$size, $rounds rounds alternated"
printf "%-9s %-36s %-24s\n" way "third sync s (each round)" "worker VmHWM MiB"
declare -A secs mib
for r in $(seq "$rounds"); do
  for way in rings inplace; do
    read -r s m < <(one "$way" "$([ "$way" = inplace ] && echo --in-place)")
    secs[$way]+="$s "
    mib[$way]+="$m "
  done
done
med() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
for way in rings inplace; do
  printf "%-9s %-36s %-24s\n" "$way" "${secs[$way]}" "${mib[$way]}"
done
r=$(med <<<"${secs[rings]}"); i=$(med <<<"${secs[inplace]}")
echo "in place: the median sync takes $(echo "$i / $r" | bc -l | xargs printf "%.2f") x the rings' ($i s against $r s);" \
  "the worker's peak memory $(med <<<"${mib[inplace]}") MiB against $(med <<<"${mib[rings]}") MiB"

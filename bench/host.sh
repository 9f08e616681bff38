#!/usr/bin/env bash
# Host data plane benchmark: one sync of a synthetic model (default 1G) to 1
# and 3 local workers over shm and tcp, each reported as a ratio to a
# baseline measured in the same run: one memcpy of the same bytes into fresh
# memory (what a worker must do at least once per sync). Ratios, not
# absolute numbers, are what compare across machines.
# Usage: bench/host.sh [SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
size=${1:-1G}
bazel build -c opt //server:wtx-worker //client:wtx //bench:memcpy_baseline 2>&1 |
  grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
bytes=$(numfmt --from=iec "$size")
tmp=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT
for i in 0 1 2; do
  "$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/p$i" --log-level warn 2>/dev/null &
  pids+=($!)
done
for i in 0 1 2; do for _ in $(seq 100); do [ -s "$tmp/p$i" ] && break; sleep 0.1; done; done
w1="127.0.0.1:$(cat "$tmp/p0")"
w3="$w1,127.0.0.1:$(cat "$tmp/p1"),127.0.0.1:$(cat "$tmp/p2")"
base=$("$bin/bench/memcpy_baseline" "$bytes" | awk '/fresh/ {print $2}')
echo "cores $(nproc)  size $size  baseline memcpy into fresh memory: $base GB/s"
printf "%-8s %-8s %10s %10s\n" backend workers "GB/s" "x memcpy"
for backend in shm tcp; do
  for ws in 1 3; do
    w=$([ "$ws" = 1 ] && echo "$w1" || echo "$w3")
    "$bin/client/wtx" push --workers "$w" --backend "$backend" "synthetic:$size" >/dev/null # warm-up
    line=$("$bin/client/wtx" push --workers "$w" --backend "$backend" "synthetic:$size")
    gbps=$(echo "$line" | sed -E 's/.*\(([0-9.]+) GB\/s\).*/\1/')
    printf "%-8s %-8s %10s %10.2f\n" "$backend" "$ws" "$gbps" "$(echo "$gbps / $base" | bc -l)"
  done
done

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
. bench/common.sh
start_worker 0 0; w1=$addr; first_start_ms=$start_ms
start_worker 0 1; w3="$w1,$addr"
start_worker 0 2; w3="$w3,$addr"
echo "wtx-worker start to serving: ${first_start_ms} ms (10 ms polling)"
echo "cores $(nproc)  size $size  baseline memcpy into fresh memory: $base GB/s (warm: $base_warm GB/s)"
printf "%-9s %-8s %10s %10s\n" backend workers "GB/s" "x memcpy"
for backend in shm tcp; do
  bench_run "$backend" "$w1" 1
  bench_run "$backend" "$w3" 3
done

#!/usr/bin/env bash
# Tensor-parallel workers against whole ones, in one run: the same synthetic
# model pushed by one trainer (wtx push --repeat 3, the third sync measured)
# to two workers of tensor-parallel ranks 0 and 1 of 2, and to two workers
# that hold the whole model, over shm and tcp. Per worker: the bytes it
# receives and publishes, its peak memory; per sync: the wall time; and a
# delta sync to the tensor-parallel workers with nothing changed. Then the
# planner at real scale (bench/plan_scale, Qwen3-235B-A22B on 64 ranks to
# 8 x TP8). Every figure is a ratio to the whole-model figure of the same run.
# Usage: bench/sharded.sh [SIZE]   (default 1G; run.sh --quick passes 256M)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1G}
. bench/common.sh
bazel build -c opt //bench:plan_scale 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
ratio() { echo "$1 / $2" | bc -l | xargs printf "%.2f"; }
worker_bytes() { "$bin/client/wtx" info "$1" | sed -nE 's/.* bytes ([0-9]+) .*/\1/p'; }
hwm_mib() { echo $(( $(awk '/VmHWM/ {print $2}' /proc/"$1"/status) / 1024 )); }

echo "# tensor-parallel workers vs whole ones  $(date -u +%F)  $(nproc) cores  model synthetic:$size"
printf "%-8s %-6s %12s %12s %14s %12s\n" backend kind "sync s" "bytes/worker" "bytes vs whole" \
  "peak MiB"
for backend in shm tcp; do
  start_tp 0 "$backend-t0"; t0=$addr; t0pid=${pids[-1]}
  start_tp 1 "$backend-t1"; t1=$addr
  start_worker 0 "$backend-w0"; w0=$addr; w0pid=${pids[-1]}
  start_worker 0 "$backend-w1"; w1=$addr
  tp_s=$("$bin/client/wtx" push --workers "$t0,$t1" --backend "$backend" --repeat 3 \
    --verify "synthetic:$size" | sync_s_all | tail -1)
  whole_s=$("$bin/client/wtx" push --workers "$w0,$w1" --backend "$backend" --repeat 3 \
    --verify "synthetic:$size" | sync_s_all | tail -1)
  tp_b=$(worker_bytes "$t0"); whole_b=$(worker_bytes "$w0")
  printf "%-8s %-6s %12s %12s %14s %12s\n" "$backend" whole "$whole_s" "$whole_b" 1.00 \
    "$(hwm_mib "$w0pid")"
  printf "%-8s %-6s %12s %12s %14s %12s\n" "$backend" "tp 2" "$tp_s" "$tp_b" \
    "$(ratio "$tp_b" "$whole_b")" "$(hwm_mib "$t0pid")"
  echo "$backend: a tensor-parallel sync takes $(ratio "$tp_s" "$whole_s") x the whole-model sync"
  delta_s=$("$bin/client/wtx" push --workers "$t0,$t1" --backend "$backend" --repeat 3 --delta \
    "synthetic:$size" | sync_s_all | tail -1)
  echo "$backend: a delta to them with nothing changed (its hash pass) takes $delta_s s =" \
    "$(ratio "$delta_s" "$tp_s") x their full sync"
  for _ in 1 2 3 4; do kill "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'; done
done
echo
echo "## the planner at real scale (bench/plan_scale, one process, CPU only)"
"$bin/bench/plan_scale" --model qwen3-235b

#!/usr/bin/env bash
# GPU data plane benchmark, on a machine with an NVIDIA GPU: one sync of a
# synthetic model (default 2G) to 1 and 2 wtx-worker processes over
# cuda_ipc (all on GPU 0) and, given a GPU per rank, nccl; each as a ratio
# to the same-run baseline of bench/host.sh (one memcpy into fresh memory)
# and to shm on the same machine. Without a GPU it says so and exits 0
# having measured nothing.
# Usage: bench/gpu.sh [SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu.sh: no NVIDIA GPU here: nothing measured (skipped)"
  exit 0
fi
scripts/setup.sh >/dev/null
size=${1:-2G}
gpus=$(nvidia-smi -L | wc -l)
bazel build -c opt //server:wtx-worker //client:wtx //bench:memcpy_baseline 2>&1 |
  grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
bytes=$(numfmt --from=iec "$size")
tmp=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT
start() { # start DEVICE INDEX
  WTX_CUDA_DEVICE=$1 "$bin/server/wtx-worker" --listen 127.0.0.1:0 \
    --port-file "$tmp/p$2" --log-level warn 2>"$tmp/w$2.log" &
  pids+=($!)
  for _ in $(seq 100); do [ -s "$tmp/p$2" ] && break; sleep 0.1; done
  echo "127.0.0.1:$(cat "$tmp/p$2")"
}
a=$(start 0 0); b=$(start 0 1)
base=$("$bin/bench/memcpy_baseline" "$bytes" | awk '/fresh/ {print $2}')
nvidia-smi -L
echo "size $size  baseline memcpy into fresh memory: $base GB/s"
printf "%-9s %-8s %10s %10s\n" backend workers "GB/s" "x memcpy"
run() { # run BACKEND WORKERS LABEL
  "$bin/client/wtx" push --workers "$2" --backend "$1" "synthetic:$size" >/dev/null
  line=$("$bin/client/wtx" push --workers "$2" --backend "$1" --verify "synthetic:$size")
  gbps=$(echo "$line" | head -1 | sed -E 's/.*\(([0-9.]+) GB\/s\).*/\1/')
  printf "%-9s %-8s %10s %10.2f\n" "$1" "$3" "$gbps" "$(echo "$gbps / $base" | bc -l)"
}
run shm "$a" 1
run cuda_ipc "$a" 1
run cuda_ipc "$a,$b" 2
if [ "$gpus" -ge 2 ]; then
  c=$(start 1 2)
  run nccl "$c" 1
else
  echo "nccl: skipped (needs a GPU per rank: trainer + worker; this machine has $gpus)"
fi

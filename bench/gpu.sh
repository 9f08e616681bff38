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
. bench/common.sh
start_worker 0 0; a=$addr
start_worker 0 1; b=$addr
nvidia-smi -L
echo "size $size  baseline memcpy into fresh memory: $base GB/s (warm: $base_warm GB/s)"
printf "%-9s %-8s %10s %10s\n" backend workers "GB/s" "x memcpy"
bench_run shm "$a" 1
bench_run cuda_ipc "$a" 1
bench_run cuda_ipc "$a,$b" 2
if [ "$gpus" -ge 2 ]; then
  start_worker 1 2; c=$addr
  bench_run nccl "$c" 1
else
  echo "nccl: skipped (needs a GPU per rank: trainer + worker; this machine has $gpus)"
fi

#!/usr/bin/env bash
# README command 1, the main job: three wtx-worker processes on loopback and a
# trainer (`wtx push`) moving a synthetic GPT-style model (default 1 GB) to
# all of them, first over the shm backend, then over the tcp chain, each time
# checking every tensor's checksum on every worker against the trainer's.
# Sets up a fresh Debian 12 machine first, with only what the C build needs
# (scripts/setup.sh --build; the tests' Python is test.sh's).
# Usage: scripts/run.sh [SIZE] [WORKERS]   (e.g. 1G 3, 256M 2)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --build
size=${1:-1G}
n=${2:-3}
bazel build -c opt //server:wtx-worker //client:wtx 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

workers=""
for i in $(seq 0 $((n - 1))); do
  "$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/port$i" \
    --log-level warn 2>"$tmp/worker$i.log" &
  pids+=($!)
done
for i in $(seq 0 $((n - 1))); do
  for _ in $(seq 100); do [ -s "$tmp/port$i" ] && break; sleep 0.1; done
  workers="${workers:+$workers,}127.0.0.1:$(cat "$tmp/port$i")"
done
echo "workers: $workers"

"$bin/client/wtx" push --workers "$workers" --backend shm --version step-1 \
  --verify "synthetic:$size"
"$bin/client/wtx" push --workers "$workers" --backend tcp --version step-2 \
  --verify "synthetic:$size"
"$bin/client/wtx" info "$workers"

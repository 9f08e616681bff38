#!/usr/bin/env bash
# README command 1, the main job: two wtx-worker processes on loopback and a
# trainer (`wtx push`) moving a synthetic GPT-style model (default 1 GB) to
# both over the shm backend, then checking every tensor's checksum on every
# worker against the trainer's. Sets up a fresh Debian 12 machine first.
# Usage: scripts/run.sh [SIZE]   (e.g. 1G, 256M)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
size=${1:-1G}
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

for i in 0 1; do
  "$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/port$i" \
    2>"$tmp/worker$i.log" &
  pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 100); do [ -s "$tmp/port$i" ] && break; sleep 0.1; done
done
workers="127.0.0.1:$(cat "$tmp/port0"),127.0.0.1:$(cat "$tmp/port1")"
echo "workers: $workers"

"$bin/client/wtx" push --workers "$workers" --backend shm --version step-1 \
  --verify "synthetic:$size"
for w in ${workers//,/ }; do "$bin/client/wtx" info "$w"; done

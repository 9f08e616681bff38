# Sourced by bench/host.sh and bench/gpu.sh: builds the binaries with -c opt,
# measures the same-run baseline, and starts workers. Sets bin, bytes, base,
# tmp; start_worker DEVICE INDEX starts a worker and sets addr to its address
# and start_ms to the milliseconds from exec to serving (its port file
# written); not in a subshell: the workers belong to this shell and its EXIT
# trap.
. bench/lib.sh
bazel build -c opt //server:wtx-worker //client:wtx //bench:memcpy_baseline 2>&1 |
  grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
bytes=$(numfmt --from=iec "$size")
baseline=$("$bin/bench/memcpy_baseline" "$bytes")
base=$(echo "$baseline" | awk '/fresh/ {print $2}')
base_warm=$(echo "$baseline" | awk '/warm/ {print $2}')
base_pieces=$(echo "$baseline" | awk '/pieces/ {print $2}')
pack=$(echo "$baseline" | awk '/^pack_gbps/ {print $2}')
pack_hashed=$(echo "$baseline" | awk '/^pack_hashed_gbps/ {print $2}')
pack_twopass=$(echo "$baseline" | awk '/^pack_twopass_gbps/ {print $2}')
pack_kernel=$(echo "$baseline" | awk '/^pack_kernel/ {print $2}')
tmp=$(mktemp -d)
pids=()
# The workers stopped and tmp removed, at exit (a script may trap EXIT
# itself and call this last).
bench_cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap bench_cleanup EXIT
start_worker() {
  local t0
  t0=$(date +%s%N)
  WTX_CUDA_DEVICE=$1 "$bin/server/wtx-worker" --listen 127.0.0.1:0 \
    --port-file "$tmp/p$2" --log-level warn 2>"$tmp/w$2.log" &
  pids+=($!)
  for _ in $(seq 1000); do [ -s "$tmp/p$2" ] && break; sleep 0.01; done
  start_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  addr="127.0.0.1:$(cat "$tmp/p$2")"
}
# What wtx push prints, one figure per sync line: its seconds, its GB/s
# (--repeat's closing line has neither); sync_s: the first sync's seconds.
sync_s_all() { sed -nE 's/.* in ([0-9.e-]+) s .*/\1/p'; }
sync_s() { sync_s_all | head -1; }
gbps_all() { sed -nE 's/.*\(([0-9.]+) GB\/s\).*/\1/p'; }
# bench_run BACKEND WORKERS LABEL: three syncs from one trainer (wtx push
# --repeat 3), as a training loop makes them; the third is measured (a worker
# reaches its steady state, staging into the buffers of the version before
# last, from the third sync on: that is every RL step after the first two).
bench_run() {
  local gbps
  gbps=$("$bin/client/wtx" push --workers "$2" --backend "$1" --repeat 3 "synthetic:$size" |
    gbps_all | tail -1)
  printf "%-9s %-8s %10s %10.2f\n" "$1" "$3" "$gbps" "$(echo "$gbps / $base" | bc -l)"
}
# start_tp RANK INDEX: a worker of tensor-parallel rank RANK of 2 (rules in
# $tmp/rules, written here); sets addr.
start_tp() {
  [ -s "$tmp/rules" ] || tp_rules "$tmp/rules"
  "$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/p$2" --log-level warn \
    --shard-rules "$tmp/rules" --tp-rank "$1" --tp-size 2 2>"$tmp/w$2.log" &
  pids+=($!)
  for _ in $(seq 1000); do [ -s "$tmp/p$2" ] && break; sleep 0.01; done
  addr="127.0.0.1:$(cat "$tmp/p$2")"
}

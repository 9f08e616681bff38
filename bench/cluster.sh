#!/usr/bin/env bash
# A simulated cluster, where the links are the limit and not this machine's
# cores: every trainer rank and every worker gets a host of its own (a
# network namespace joined to the others through a bridge, 10.77.0.0/24,
# inside those namespaces only), and every host's link the same rate in
# each direction (tc tbf on both ends of its veth pair). Then the same
# synthetic model, held by 4 ranks (FSDP, wtx push --world 4), goes to 4
# tensor-parallel workers (TP 4) two ways: every rank sending what it owns
# (many senders), and one host sending every byte (rank 0 alone). Reports
# the third sync of each and how near each sender's link ran to its rate.
# Then deltas on the same links, to a whole replica on each worker host:
# 4 ranks that each own a quarter of the tensors whole (bench/delta_bench.c,
# as a pipeline's stages own layers), then 4 ranks that each hold a shard
# of every tensor (FSDP: Shard(0) over all 4, so each replica's tensor is
# fed by 4 ranks), then 4 ranks that each hold a quarter of every tensor's
# columns (row-parallel: Shard(1), so each replica's tensor comes in
# boxes), with 1 % of every tensor's elements changed between syncs, sent
# as whole tensors and as patches, against the same ranks' full sync.
# Root only (ip netns, veth, tbf); everything is torn down on exit.
# Usage: bench/cluster.sh [SIZE] [RATE]   (default 128M 400mbit)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-128M}
rate=${2:-400mbit}
if [ "$(id -u)" != 0 ] || ! ip netns add wtx-probe 2>/dev/null; then
  echo "bench/cluster.sh: needs root and network namespaces; skipped" >&2
  exit 0
fi
ip netns del wtx-probe
bazel build -c opt //server:wtx-worker //client:wtx //bench:delta_bench 2>&1 |
  grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
hosts=(r0 r1 r2 r3 w0 w1 w2 w3)
pids=()
teardown() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for h in "${hosts[@]}"; do
    ip link del "wtx-$h-b" 2>/dev/null || true
    ip netns del "wtx-$h" 2>/dev/null || true
  done
  ip link del wtx-br 2>/dev/null || true
  rm -rf "$tmp"
}
trap teardown EXIT
ip link add wtx-br type bridge
ip link set wtx-br up
i=10
for h in "${hosts[@]}"; do
  ip netns add "wtx-$h"
  ip link add "wtx-$h-b" type veth peer name eth0 netns "wtx-$h"
  ip link set "wtx-$h-b" master wtx-br up
  ip -n "wtx-$h" addr add "10.77.0.$i/24" dev eth0
  ip -n "wtx-$h" link set eth0 up
  ip -n "wtx-$h" link set lo up
  # The host's link: its rate out (eth0) and in (the bridge's end).
  ip netns exec "wtx-$h" tc qdisc add dev eth0 root tbf rate "$rate" burst 64kb latency 50ms
  tc qdisc add dev "wtx-$h-b" root tbf rate "$rate" burst 64kb latency 50ms
  eval "ip_$h=10.77.0.$i"
  i=$((i + 1))
done
# (Started in the background, commands run as ip netns exec itself, not in a
# function's subshell: $! is then the process the trap stops.)
in_ns() { local h=$1; shift; ip netns exec "wtx-$h" "$@"; }
tx_bytes() { in_ns "$1" cat /sys/class/net/eth0/statistics/tx_bytes; }
. bench/lib.sh
# serve_in HOST FILE [ARGS]: a wtx-worker on HOST, its port in $tmp/FILE;
# served: its address.
serve_in() {
  local h=$1 f=$2 a
  shift 2
  eval "a=\$ip_$h"
  ip netns exec "wtx-$h" "$bin/server/wtx-worker" --listen "$a:0" --port-file "$tmp/$f" \
    --log-level warn "$@" 2>"$tmp/$f.log" &
  pids+=($!)
  for _ in $(seq 1000); do [ -s "$tmp/$f" ] && break; sleep 0.01; done
  served="$a:$(cat "$tmp/$f")"
}
tp_rules "$tmp/rules"
workers=""
for k in 0 1 2 3; do
  serve_in "w$k" "p$k" --shard-rules "$tmp/rules" --tp-rank "$k" --tp-size 4
  workers+="${workers:+,}$served"
done
ranks=""
for r in 0 1 2 3; do eval "a=\$ip_r$r"; ranks+="${ranks:+,}$a:47000"; done
export WTX_SESSION_TOKEN=bench-cluster-session-token-01
secs() { sed -nE 's/.* in ([0-9.e-]+) s .*/\1/p' | tail -1; }
sent() { sed -nE 's/^pushed [0-9]+ params, ([0-9]+) bytes.*/\1/p' | tail -1; }
for r in 0 1 2 3; do b0[$r]=$(tx_bytes "r$r"); done
for r in 0 1 2 3; do
  ip netns exec "wtx-r$r" "$bin/client/wtx" push --workers "$workers" --backend tcp --world 4 --rank "$r" \
    --rank-addresses "$ranks" --repeat 3 --timeout-ms 120000 "synthetic:$size" \
    >"$tmp/rank$r.out" 2>&1 &
  rp[$r]=$!
done
for r in 0 1 2 3; do wait "${rp[$r]}" || { cat "$tmp/rank$r.out" >&2; exit 1; }; done
many_s=$(secs <"$tmp/rank0.out")
one=$(in_ns r0 "$bin/client/wtx" push --workers "$workers" --backend tcp --repeat 3 \
  --timeout-ms 120000 --data-address "$ip_r0:0" "synthetic:$size")
one_s=$(echo "$one" | secs)
one_b=$(echo "$one" | sent)
ratio() { echo "$1 / $2" | bc -l | xargs printf "%.2f"; }
rate_bps=$(echo "$rate" | sed -E 's/mbit$/*1000000/; s/gbit$/*1000000000/' | bc)
echo "# simulated cluster  $(date -u +%F)  $(nproc) cores  model synthetic:$size  links $rate"
echo "# 4 trainer hosts (FSDP) -> 4 worker hosts (TP 4), tcp; the third sync of each way"
printf "%-18s %12s %10s %18s\n" way "bytes/link" "sync s" "link use"
for r in 0 1 2 3; do
  b=$(sent <"$tmp/rank$r.out"); s=$(secs <"$tmp/rank$r.out")
  printf "%-18s %12s %10s %17s\n" "many: rank $r" "$b" "$s" \
    "$(ratio "$(echo "$b * 8 / $s" | bc -l)" "$rate_bps")x"
done
printf "%-18s %12s %10s %17s\n" "rank 0 alone" "$one_b" "$one_s" \
  "$(ratio "$(echo "$one_b * 8 / $one_s" | bc -l)" "$rate_bps")x"
echo "many senders: $(ratio "$one_s" "$many_s") x faster than rank 0 alone (goal: 3x)"
goal "many senders, simulated cluster: speed vs rank 0 alone" "$(ratio "$one_s" "$many_s")" \
  "rank 0 sending every byte over the same links" ge 3
# Deltas: a whole replica on each worker host (no model spec: delta_bench's
# tensors are its own), each taking every tensor from the ranks that own
# it; fresh ones (replicas NAME) for a layout of other shapes, since a
# worker keeps its tensors' shapes.
replicas() {
  replicas=""
  for k in 0 1 2 3; do
    serve_in "w$k" "$1$k"
    replicas+="${replicas:+,}$served"
  done
}
replicas q
# deltas LAYOUT PORT: delta_bench on the 4 ranks, owning the tensors as
# LAYOUT says (pipeline: a quarter of the tensors whole each; fsdp: every
# tensor Shard(0) over all 4; rows: every tensor Shard(1) over all 4), its
# ranks listening from PORT; $tmp/LAYOUT$r.out.
deltas() {
  local layout=$1 port=$2 ranks="" r a
  for r in 0 1 2 3; do eval "a=\$ip_r$r"; ranks+="${ranks:+,}$a:$port"; done
  for r in 0 1 2 3; do
    ip netns exec "wtx-r$r" env DELTA_BENCH_LAYOUT="$layout" "$bin/bench/delta_bench" \
      "$replicas" "$size" 64 tcp "$r" 4 "$ranks" >"$tmp/$layout$r.out" 2>&1 &
    rp[$r]=$!
  done
  for r in 0 1 2 3; do wait "${rp[$r]}" || { cat "$tmp/$layout$r.out" >&2; exit 1; }; done
}
# dfield KIND FIELD RANK [patches] [LAYOUT]: a field of delta_bench's line
dfield() {
  awk -v k="$1" -v f="$2" -v p="${4:-}" '/^# patches/ {in_p = 1} $1 == k && (in_p == (p != "")) {print $f}' "$tmp/${5:-pipeline}$3.out"
}
dbytes() {
  local n=0 r
  for r in 0 1 2 3; do n=$((n + $(dfield "$1" 3 "$r" "${2:-}" "${3:-pipeline}"))); done
  echo "$n"
}
deltas pipeline 47100
deltas fsdp 47200
replicas rows
deltas rows 47300
for layout in pipeline fsdp rows; do
  full_s=$(dfield full 2 0 "" "$layout")
  full_b=$(dbytes full "" "$layout")
  for p in "" patches; do
    s=$(dfield elements1 2 0 "$p" "$layout")
    echo "deltas ($layout), 1 % of every tensor's elements changed, ${p:-whole tensors}:" \
      "the sync takes $(ratio "$s" "$full_s") x the 4 ranks' full sync ($s s against" \
      "$full_s s) and moves $(echo "$(dbytes elements1 "$p" "$layout") / $full_b" | bc -l |
      xargs printf "%.3f") x its bytes"
  done
  goal "many senders, cluster, $layout: 1 % patch delta, time" \
    "$(ratio "$(dfield elements1 2 0 patches "$layout")" "$full_s")" "the same 4 ranks' full sync" le 0.10
done

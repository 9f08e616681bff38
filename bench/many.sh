#!/usr/bin/env bash
# Many senders against rank 0 alone, in one run: the same synthetic model,
# held by a trainer of 4 ranks (FSDP: dim 0 of every tensor split over them,
# wtx push --world 4, one process per rank), synced over tcp to two workers
# of tensor-parallel ranks 0 and 1 of 2; the same 4 ranks splitting dim 1
# instead (--shard-dim 1, a row-parallel cut: every piece travels as
# boxes); the same 4 ranks sending deltas of an unchanged model (--delta:
# the third sync moves nothing); then the whole model synced by one
# process (rank 0 sending every
# byte) to the same workers; then deltas from 4 ranks that each own a
# quarter of the tensors whole (a pipeline's stages: bench/delta_bench.c)
# to a whole replica, with 1 % of every tensor's elements changed, sent as
# whole tensors and as patches, against those ranks' full sync. Per way: the
# bytes each trainer link carries, and the third sync's wall time (rank 0's:
# it answers for the sync). On loopback every link shares this machine's
# cores, so the wall time here shows the cost of the protocol, not the
# links' gain; the bytes per link are what a cluster's NICs would carry.
# Usage: bench/many.sh [SIZE] [BACKEND]   (default 1G tcp; run.sh --quick
# passes 256M; BACKEND shm: the same, each sender's bytes through a ring
# in shared memory, against rank 0 alone over shm)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1G}
backend=${2:-tcp}
. bench/common.sh
ratio() { echo "$1 / $2" | bc -l | xargs printf "%.2f"; }
bytes_all() { sed -nE 's/^pushed [0-9]+ params, ([0-9]+) bytes.*/\1/p'; }
control_all() { sed -nE 's/^pushed .* ([0-9]+) control bytes.*/\1/p'; }

start_tp 0 t0; t0=$addr
start_tp 1 t1; t1=$addr
export WTX_SESSION_TOKEN=bench-many-session-token-0123
# many_run DIM PREFIX [FLAG]: 4 ranks splitting dim DIM of every tensor,
# each rank's output into $tmp/PREFIX$r.out (FLAG: --delta).
many_run() {
  local ranks="" rpids=()
  for r in 0 1 2 3; do ranks+="${ranks:+,}127.0.0.1:$(free_port)"; done
  for r in 0 1 2 3; do
    "$bin/client/wtx" push --workers "$t0,$t1" --backend "$backend" --world 4 --rank "$r" \
      --shard-dim "$1" --rank-addresses "$ranks" --repeat 3 ${3:-} "synthetic:$size" \
      >"$tmp/$2$r.out" &
    rpids+=($!)
  done
  for p in "${rpids[@]}"; do wait "$p"; done
}
many_run 0 rank
many_s=$(sync_s_all <"$tmp/rank0.out" | tail -1)
# The same split along dim 1, as a Megatron trainer's row-parallel layers
# are: no rank's piece is one run of a worker's slice, so every piece
# travels as boxes, which the workers scatter into staging.
many_run 1 rows
rows_s=$(sync_s_all <"$tmp/rows0.out" | tail -1)
# Deltas: the same 4 ranks, the model unchanged between syncs, so the third
# sync hashes every rank's pieces, asks the ranks, and moves nothing.
many_run 0 delta --delta
delta_s=$(sync_s_all <"$tmp/delta0.out" | tail -1)
one=$("$bin/client/wtx" push --workers "$t0,$t1" --backend "$backend" --repeat 3 "synthetic:$size")
one_s=$(echo "$one" | sync_s_all | tail -1)
one_b=$(echo "$one" | bytes_all | tail -1)

echo "# many senders vs rank 0 alone  $(date -u +%F)  $(nproc) cores  model synthetic:$size"
echo "# to 2 tensor-parallel workers over $backend; the third sync of each trainer"
printf "%-22s %14s %14s %10s\n" way "busiest link B" "vs rank 0" "sync s"
most=0
for r in 0 1 2 3; do
  b=$(bytes_all <"$tmp/rank$r.out" | tail -1)
  printf "%-22s %14s %14s %10s\n" "4 ranks: rank $r" "$b" "$(ratio "$b" "$one_b")" \
    "$(sync_s_all <"$tmp/rank$r.out" | tail -1)"
  [ "$b" -gt "$most" ] && most=$b
done
printf "%-22s %14s %14s %10s\n" "rank 0 alone" "$one_b" 1.00 "$one_s"
echo "many senders: the busiest trainer link carries $(ratio "$most" "$one_b") x rank 0's;" \
  "the sync takes $(ratio "$many_s" "$one_s") x rank 0's (loopback, $(nproc) cores)"
echo "many senders splitting dim 1 (row-parallel: every piece as boxes): the sync takes" \
  "$(ratio "$rows_s" "$many_s") x dim 0's ($rows_s s against $many_s s), the busiest link" \
  "$(bytes_all <"$tmp/rows0.out" | tail -1) B from rank 0, rank 0's UpdateInfo of the" \
  "second sync $(control_all <"$tmp/rows0.out" | sed -n 2p) B"
echo "many senders, a delta with nothing changed: the sync takes $(ratio "$delta_s" "$many_s")" \
  "x the full sync's ($delta_s s against $many_s s; every rank's hash pass over its part)"
# Patches from many senders (bench/delta_bench.c, a process per rank):
# field KIND N R [patches] of rank R's lines; bytes summed over ranks.
bazel build -c opt //bench:delta_bench 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
start_worker 0 pw
ranks=""
for r in 0 1 2 3; do ranks+="${ranks:+,}127.0.0.1:$(free_port)"; done
dpids=()
for r in 0 1 2 3; do
  "$bin/bench/delta_bench" "$addr" "$size" 200 "$backend" "$r" 4 "$ranks" >"$tmp/pd$r.out" &
  dpids+=($!)
done
for p in "${dpids[@]}"; do wait "$p"; done
dfield() {
  awk -v k="$1" -v f="$2" -v p="${4:-}" '/^# patches/ {in_p = 1} $1 == k && (in_p == (p != "")) {print $f}' "$tmp/pd$3.out"
}
dbytes() { local n=0; for r in 0 1 2 3; do n=$((n + $(dfield "$1" 3 "$r" "${2:-}"))); done; echo "$n"; }
full_s=$(dfield full 2 0); full_b=$(dbytes full)
for p in "" patches; do
  for k in tensors5 elements1; do
    echo "many senders, a delta ($size in 200 tensors, each one rank's) with $k changed," \
      "${p:-whole tensors}: the sync takes $(ratio "$(dfield "$k" 2 0 $p)" "$full_s") x" \
      "the 4 ranks' full sync ($(dfield "$k" 2 0 $p) s against $full_s s) and moves" \
      "$(echo "$(dbytes "$k" $p) / $full_b" | bc -l | xargs printf "%.4f") x its bytes"
  done
done
c1=$(control_all <"$tmp/rank0.out" | head -1)
c2=$(control_all <"$tmp/rank0.out" | sed -n 2p)
echo "control plane (rank 0's UpdateInfo to every worker): first sync $c1 B, second $c2 B" \
  "($(ratio "$c2" "$c1") x: tensors named by position, no per-tensor metadata)"

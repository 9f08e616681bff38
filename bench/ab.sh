#!/usr/bin/env bash
# A/B of two commits in one run: builds wtx-worker and wtx (-c opt) at OLD
# and at NEW (default: the working tree), starts one worker of each, warms
# both up (two syncs: the steady state), then pushes to them alternately,
# ROUNDS times each, and prints every sync time per side. The figures of
# bench/results/*.md's "what changed" tables come from this.
# Usage: bench/ab.sh OLD [NEW] [--backend shm|tcp] [--size 1G | --tiny N]
#                    [--workers N] [--rounds 4] [--first] [--wall] [--repeat N]
#                    [-- extra wtx push flags]
#   --tiny N: N tiny tensors (bench/tiny_model.py), the control plane
#   --first: the first sync to fresh workers (started anew for each one)
#            instead of the steady state
#   --wall: each push's process, start to exit, instead of its sync time
#   --repeat N: each push makes N syncs from one trainer (wtx push --repeat)
#            and its figure is the median of syncs 2-N, a training loop's
#            steady state, instead of its one sync
# Unless --first, it also prints each side's workers' CPU (utime + stime)
# per sync of the measured pushes, every sync of each counted.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
old=$1; shift
new=
[ $# -gt 0 ] && [ "${1#-}" = "$1" ] && { new=$1; shift; }
backend=shm size=1G tiny= workers=1 rounds=4 first= wall= repeat= extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --backend) backend=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --tiny) tiny=$2; shift 2 ;;
    --first) first=1; shift ;;
    --wall) wall=1; shift ;;
    --workers) workers=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "bench/ab.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
tmp=$(mktemp -d)
pids=()
# A worktree's Bazel server would idle for hours after its tree is gone (a
# JVM of a few hundred MB per run): shut down before removing.
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
      for w in "$tmp/src-old" "$tmp/src-new"; do
        [ -d "$w" ] && (cd "$w" && bazel shutdown 2>/dev/null)
        git worktree remove --force "$w" 2>/dev/null || true
      done; rm -rf "$tmp"' EXIT

# build SIDE REV: the two binaries of REV (the working tree when empty).
build() {
  local dir=.
  if [ -n "$2" ]; then
    dir="$tmp/src-$1"
    git worktree add -q --detach "$dir" "$2"
  fi
  (cd "$dir" && bazel build -c opt //server:wtx-worker //client:wtx 2>&1 |
     grep -E '^(ERROR|FAILED)' && exit 1
   bin=$(bazel info -c opt bazel-bin 2>/dev/null)
   cp "$bin/server/wtx-worker" "$bin/client/wtx" "$tmp/" &&
   mv "$tmp/wtx-worker" "$tmp/worker-$1" && mv "$tmp/wtx" "$tmp/wtx-$1") || exit 1
}
build old "$old"
build new "$new"
model="synthetic:$size"
if [ -n "$tiny" ]; then
  scripts/setup.sh >/dev/null
  .venv/bin/python bench/tiny_model.py "$tiny" "$tmp/tiny.safetensors"
  model="$tmp/tiny.safetensors"
fi

# start SIDE: fresh workers for SIDE; ws-SIDE gets their addresses,
# side_pids their pids.
declare -A side_pids
start() {
  local list= i
  side_pids[$1]=
  for i in $(seq "$workers"); do
    rm -f "$tmp/p-$1-$i"
    "$tmp/worker-$1" --listen 127.0.0.1:0 --port-file "$tmp/p-$1-$i" --log-level warn &
    pids+=($!)
    side_pids[$1]="${side_pids[$1]} $!"
    for _ in $(seq 500); do [ -s "$tmp/p-$1-$i" ] && break; sleep 0.01; done
    list="${list:+$list,}127.0.0.1:$(cat "$tmp/p-$1-$i")"
  done
  echo "$list" >"$tmp/ws-$1"
}
stop() { # SIDE
  local p
  for p in ${side_pids[$1]}; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
push() { # SIDE: one sync, its seconds (--wall: the process's)
  local t0=$(date +%s%N) s
  if [ -n "$repeat" ]; then
    s=$("$tmp/wtx-$1" push --workers "$(cat "$tmp/ws-$1")" --backend "$backend" \
        --repeat "$repeat" "${extra[@]}" "$model" | sed -nE 's/.* median ([0-9.e-]+) s.*/\1/p')
  else
    s=$("$tmp/wtx-$1" push --workers "$(cat "$tmp/ws-$1")" --backend "$backend" \
        "${extra[@]}" "$model" | sed -nE 's/.* in ([0-9.]+) s .*/\1/p' | head -1)
  fi
  [ -n "$wall" ] && s=$(awk -v ns=$(($(date +%s%N) - t0)) 'BEGIN { printf "%.4f", ns / 1e9 }')
  echo "$s"
}
declare -A t
if [ -n "$first" ]; then
  for _ in $(seq "$rounds"); do
    for side in old new; do start "$side"; t[$side]="${t[$side]:-} $(push "$side")"; stop "$side"; done
  done
  syncs="the first sync to fresh workers, $rounds each"
else
  # The workers' CPU (utime + stime, all of a side's workers) over the
  # measured pushes, so that a change's cost on the worker shows as well.
  # shellcheck disable=SC2086 # a side's pids, one word each
  ticks() { cpu_ticks ${side_pids[$1]}; }
  declare -A cpu
  for side in old new; do start "$side"; push "$side" >/dev/null; push "$side" >/dev/null; cpu[$side]=0; done
  for _ in $(seq "$rounds"); do
    for side in old new; do
      c0=$(ticks "$side")
      t[$side]="${t[$side]:-} $(push "$side")"
      cpu[$side]=$((cpu[$side] + $(ticks "$side") - c0))
    done
  done
  syncs="syncs 3-$((rounds + 2))"
fi
what="synthetic:$size"
[ -n "$tiny" ] && what="$tiny tiny tensors"
[ -n "$wall" ] && syncs="$syncs, each push's process start to exit"
[ -n "$repeat" ] && syncs="$rounds pushes each after two warm-up syncs; each figure the median of a push's syncs 2-$repeat"
echo "# $backend, $workers worker(s), $what ${extra[*]}, $syncs, alternating"
echo "old ($old):${t[old]} s"
echo "new (${new:-working tree}):${t[new]} s"
if [ -z "$first" ]; then  # per sync: a push makes --repeat syncs, else one
  n=$((rounds * ${repeat:-1}))
  for side in old new; do
    awk -v c="${cpu[$side]}" -v hz="$(getconf CLK_TCK)" -v n=$n -v s=$side \
      'BEGIN {printf "%s: the workers'"'"' CPU %.4f s per sync\n", s, c / hz / n}'
  done
fi

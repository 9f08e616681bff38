#!/usr/bin/env bash
# Delta syncs against full syncs of the same model to the same worker, in
# one run (bench/delta_bench.c): a model of SIZE in 200 bf16 tensors, over
# shm and tcp, with nothing changed, 5 % of the tensors changed and 1 % of
# every tensor's elements changed, each with whole tensors and with
# patches; then 40k tiny tensors with nothing changed. Each figure is the delta's time (hash pass included) and bytes
# over the full sync's.
# Usage: bench/delta.sh [SIZE]   (default 1G; run.sh --quick passes 256M)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1G}
. bench/common.sh
bazel build -c opt //bench:delta_bench 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
ratio() { echo "$1 / $2" | bc -l | xargs printf "%.3f"; }  # finer than run.sh's
# field KIND N FILE [patches]: field N of KIND's line, before "# patches"
# or (patches) after it.
field() {
  awk -v k="$1" -v f="$2" -v p="${4:-}" '/^# patches/ {in_p = 1} $1 == k && (in_p == (p != "")) {print $f}' "$3"
}
start_worker 0 d0
echo "## delta syncs ($size in 200 tensors; 40k tiny tensors)"
for backend in shm tcp; do
  out="$tmp/delta-$backend"
  "$bin/bench/delta_bench" "$addr" "$size" 200 "$backend" >"$out"
  full_s=$(field full 2 "$out"); full_b=$(field full 3 "$out")
  for p in "" patches; do
    for k in none tensors5 elements1; do
      printf "%-4s %-7s %-10s time %s s = %s x full (%s s); bytes %s x full; tensors sent %s of 200\n" \
        "$backend" "${p:-tensors}" "$k" "$(field "$k" 2 "$out" $p)" \
        "$(ratio "$(field "$k" 2 "$out" $p)" "$full_s")" "$full_s" \
        "$(ratio "$(field "$k" 3 "$out" $p)" "$full_b")" "$(field "$k" 4 "$out" $p)"
    done
  done
  full="a full sync of the model, $backend"
  goal "delta, $size, $backend, 5 % of tensors changed: time" \
    "$(ratio "$(field tensors5 2 "$out")" "$full_s")" "$full" le 0.10
  goal "delta, $size, $backend, 1 % of elements changed: time (patches)" \
    "$(ratio "$(field elements1 2 "$out" patches)" "$full_s")" "$full" le 0.10
  goal "delta, $size, $backend, 1 % of elements changed: bytes (patches)" \
    "$(ratio "$(field elements1 3 "$out" patches)" "$full_b")" "$full" le 0.03
done
start_worker 0 d1
out="$tmp/delta-tiny"
"$bin/bench/delta_bench" "$addr" 640K 40000 shm >"$out"
printf "shm  40k tiny, nothing changed: %s s (goal < 0.005 s); full sync %s s\n" \
  "$(field none 2 "$out")" "$(field full 2 "$out")"
goal "delta, 40k tiny tensors, nothing changed: seconds" "$(field none 2 "$out")" \
  "none: an absolute bound" le 0.005

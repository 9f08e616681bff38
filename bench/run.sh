#!/usr/bin/env bash
# The benchmark, one command: every figure is a ratio to a baseline measured
# in the same run on the same machine (never an absolute target).
#   control plane  one sync of N tiny tensors (wtx push, fresh worker) vs one
#                  vLLM-style JSON POST of the same N names/dtypes/shapes to
#                  FastAPI (bench/json_baseline.py); and 40k from the Python
#                  package vs the C CLI (bench/python_push.sh --tiny)
#   shm            steady-state sync (third) to 1 and 3 workers vs memcpy
#                  (warm and into fresh memory, bench/memcpy_baseline); and,
#                  checksums off, vs two copies pipelined through a ring in
#                  one process (bench/pipeline_baseline), the ceiling of a
#                  design that copies twice; and the ceiling of one copy,
#                  the worker adopting sealed pages (bench/adopt_baseline)
#   tcp            the same vs one raw loopback TCP stream (bench/socket_baseline)
#   checksums      shm, 1 worker, XXH3 on vs off
#   memory         peak RSS of a worker and of the trainer vs the model
#   scaling        shm, 1 worker, time per size
# Usage: bench/run.sh [--quick]   (--quick: 256M and small N, under a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = "--quick" ] && quick=1
if [ $quick = 1 ]; then size=256M; counts="1000 10000"; sizes="64M 256M"
else size=1G; counts="1000 10000 40000 65000 100000"; sizes="64M 256M 1G 4G"; fi
. bench/common.sh
bazel build -c opt //bench:socket_baseline //bench:pipeline_baseline //bench:adopt_baseline 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
py=.venv/bin/python
ratio() { echo "$1 / $2" | bc -l | xargs printf "%.2f"; }
sync_s() { sed -nE 's/.* in ([0-9.]+) s .*/\1/p' | head -1; }

echo "# wtx benchmark  $(date -u +%F)  $(nproc) cores  $(free -g | awk '/Mem:/ {print $2}') GiB  quick=$quick"
echo "baseline memcpy: fresh $base GB/s, warm $base_warm GB/s, warm in 256 KiB pieces $base_pieces GB/s"
sock=$("$bin/bench/socket_baseline" "$bytes" | awk '{print $2}')
echo "baseline loopback TCP stream: $sock GB/s"
pipe=$("$bin/bench/pipeline_baseline" "$bytes" | awk '{print $2}')
echo "baseline two copies pipelined through a 4 x 4 MiB ring, one process: $pipe GB/s"
adopt=$("$bin/bench/adopt_baseline" "$bytes" | awk '{print $2}')
echo "baseline one copy into a sealed memfd per 4 MiB chunk, mapped and hashed, one process: $adopt GB/s"

echo
echo "## control plane: one sync of N tiny tensors vs one JSON POST of the same metadata"
echo "# first: a fresh worker, the update sends every ParamMeta; steady: the"
echo "# best of the next seven, which name tensors by position in the worker's"
echo "# table (UpdateInfo.layout), as every RL step after the first does;"
echo "# JSON POST: the best of seven"
printf "%-8s %10s %10s %12s %12s %12s\n" N "first s" "steady s" "JSON POST s" "JSON/first" "JSON/steady"
json=$($py bench/json_baseline.py $counts)
for n in $counts; do
  $py bench/tiny_model.py "$n" "$tmp/tiny$n.safetensors"
  start_worker 0 "cp$n"
  first=$("$bin/client/wtx" push --workers "$addr" --buffer-size 64M "$tmp/tiny$n.safetensors" | sync_s)
  best=
  for _ in 1 2 3 4 5 6 7; do  # the JSON POST's statistic too
    s=$("$bin/client/wtx" push --workers "$addr" --buffer-size 64M "$tmp/tiny$n.safetensors" | sync_s)
    best=$(echo "${best:-$s} $s" | awk '{print ($1 < $2) ? $1 : $2}')
  done
  j=$(echo "$json" | awk -v n="$n" '$2 == n {print $3}')
  printf "%-8s %10s %10s %12s %12s %12s\n" "$n" "$first" "$best" "$j" "$(ratio "$j" "$first")" \
    "$(ratio "$j" "$best")"
  kill "${pids[-1]}" 2>/dev/null || true
done
n=$(echo $counts | awk '{print ($NF >= 40000) ? 40000 : $NF}')
[ -f "$tmp/tiny$n.safetensors" ] || $py bench/tiny_model.py "$n" "$tmp/tiny$n.safetensors"
start_worker 0 "e2e"
for _ in 1 2; do "$bin/client/wtx" push --workers "$addr" "$tmp/tiny$n.safetensors" >/dev/null; done
w0=$(date +%s%N)
"$bin/client/wtx" push --workers "$addr" "$tmp/tiny$n.safetensors" >/dev/null
echo "wtx push of $n tiny tensors, end to end (process start to exit, steady state):" \
  "$(( ($(date +%s%N) - w0) / 1000000 )) ms"
kill "${pids[-1]}" 2>/dev/null || true
if [ $quick = 0 ]; then
  echo "the same $n tiny tensors from the Python package, and into a Python host (bench/python_push.sh --tiny $n):"
  bench/python_push.sh --tiny "$n" 2>/dev/null | tail -4 | sed 's/^/  /'
fi
echo
echo "## data plane, size $size, steady state (best of syncs 3-5)"
start_worker 0 a; w1=$addr; w1pid=${pids[-1]}
start_worker 0 b; w3="$w1,$addr"
start_worker 0 c; w3="$w3,$addr"
printf "%-9s %-8s %10s %14s %14s\n" backend workers "GB/s" "x warm memcpy" "x baseline"
for backend in shm tcp; do
  for set in "1 $w1" "3 $w3"; do
    n=${set%% *}; ws=${set#* }
    bench_run "$backend" "$ws" "$n" >/dev/null
    g=0  # the best of three steady-state syncs
    for _ in 1 2 3; do
      line=$("$bin/client/wtx" push --workers "$ws" --backend "$backend" "synthetic:$size")
      g=$(echo "$line" | sed -E 's/.*\(([0-9.]+) GB\/s\).*/\1/' | awk -v b="$g" '{print ($1 > b) ? $1 : b}')
    done
    agg=$(echo "$g * $n" | bc -l)  # bytes delivered per second, all workers
    [ "$backend$n" = shm1 ] && shm1=$g
    ref=$base_warm; [ "$backend" = tcp ] && ref=$sock
    printf "%-9s %-8s %10s %14s %14s  (delivered %.2f GB/s)\n" "$backend" "$n" "$g" \
      "$(ratio "$g" "$base_warm")" "$(ratio "$g" "$ref")" "$agg"
  done
done

echo "shm, 1 worker: $shm1 GB/s = $(ratio "$shm1" "$adopt") x the one-copy ceiling (adopting sealed pages)"
echo
echo "## checksums: shm and tcp, 1 worker, XXH3 on vs off (best of 3, alternating)"
for backend in shm tcp; do
  on=; off=
  for _ in 1 2 3; do
    a=$("$bin/client/wtx" push --workers "$w1" --backend $backend --checksum "synthetic:$size" | sync_s)
    b=$("$bin/client/wtx" push --workers "$w1" --backend $backend --no-checksum "synthetic:$size" | sync_s)
    on=$(echo "${on:-$a} $a" | awk '{print ($1 < $2) ? $1 : $2}')
    off=$(echo "${off:-$b} $b" | awk '{print ($1 < $2) ? $1 : $2}')
  done
  echo "$backend: on ${on} s, off ${off} s: on / off = $(ratio "$on" "$off")"
  [ $backend = shm ] && shm_off=$off
done
g=$(echo "$bytes / $shm_off / 1000000000" | bc -l | xargs printf "%.2f")
echo "shm, checksums off: $g GB/s = $(ratio "$g" "$pipe") x the two-copy pipeline baseline"

echo
echo "## memory: peak RSS after the syncs above vs the model ($size)"
hwm=$(awk '/VmHWM/ {print $2}' /proc/"$w1pid"/status)
tr=$( { /usr/bin/time -f "%M" "$bin/client/wtx" push --workers "$w1" --backend shm "synthetic:$size" >/dev/null; } 2>&1 | tail -1)
echo "worker peak $((hwm / 1024)) MiB = $(ratio "$hwm * 1024" "$bytes") x model (bound: 2.1 + buffers)"
echo "trainer peak $((tr / 1024)) MiB = $(ratio "$tr * 1024" "$bytes") x model (bound: 1 + buffers: shm 4 x 4 MiB)"

echo
echo "## scaling: shm, 1 worker, a fresh worker per size"
printf "%-6s %10s %12s\n" size "sync s" "s per GiB"
for s in $sizes; do
  start_worker 0 "s$s"
  for _ in 1 2; do "$bin/client/wtx" push --workers "$addr" --backend shm "synthetic:$s" >/dev/null; done
  t=$("$bin/client/wtx" push --workers "$addr" --backend shm "synthetic:$s" | sync_s)
  gib=$(numfmt --from=iec "$s" | awk '{print $1 / 1073741824}')
  printf "%-6s %10s %12s\n" "$s" "$t" "$(ratio "$t" "$gib")"
  kill "${pids[-1]}" 2>/dev/null || true
done

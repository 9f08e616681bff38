#!/usr/bin/env bash
# The benchmark, one command: every figure is a ratio to a baseline measured
# in the same run on the same machine (never an absolute target). Each side
# is a best of several: the syncs as below, each baseline of three runs
# (the memcpy into fresh memory: of one; a first sync to fresh workers: the
# median of several, a best of them being luck).
#   control plane  one sync of N tiny tensors (wtx push, fresh worker) vs one
#                  vLLM-style JSON POST of the same N names/dtypes/shapes to
#                  FastAPI (bench/json_baseline.py); and 40k from the Python
#                  package vs the C CLI (bench/python_push.sh --tiny)
#   shm            steady-state sync (third) to 1 and 3 workers vs memcpy
#                  (warm and into fresh memory, bench/memcpy_baseline); and,
#                  checksums off, vs two copies pipelined through a ring in
#                  one process (bench/pipeline_baseline), a design that
#                  copies twice; and two designs that copy once:
#                  the worker adopting sealed pages (bench/adopt_baseline),
#                  and the worker copying from the trainer's tensors in
#                  shared memory (bench/onecopy_baseline)
#   tcp            the same vs one raw loopback TCP stream (bench/socket_baseline),
#                  and the chain of three vs the same chain in plain C
#                  (relays that read and write, and relays that splice);
#                  and both again with the bytes sent from and received
#                  into model-sized memory, as wtx moves them, unhashed
#                  (socket_baseline ... model): what the goals cost here
#   checksums      shm and tcp, 1 worker, XXH3 on vs off; and the trainer's
#                  pack alone, hashed (in the copy's pass, and after it) vs
#                  plain (bench/memcpy_baseline)
#   CPU            shm and tcp, 1 and 3 workers: CPU seconds per sync on each
#                  side, the shortest sync the machine's cores allow for
#                  them, and the bounds that puts on the goals' ratios
#   memory         peak RSS of a worker and of the trainer vs the model
#   scaling        shm, 1 worker, time per size
#   tensor-parallel two workers of ranks 0 and 1 of 2 vs two whole ones
#                  (bench/sharded.sh): bytes, peak memory, sync time; and
#                  the planner at Qwen3-235B scale (bench/plan_scale)
#   delta syncs    nothing, 5 % of the tensors and 1 % of every tensor's
#                  elements changed vs a full sync (bench/delta.sh); and 40k
#                  tiny tensors with nothing changed
#   vLLM plugin    a vLLM of tensor-parallel size 2 vs one rank, through
#                  vLLM's routes (bench/vllm_tp.sh; full runs only): sync
#                  time and each rank's staged bytes vs the model's
#   many senders   4 FSDP ranks vs rank 0 alone to two TP workers on loopback
#                  (bench/many.sh: bytes per trainer link, sync time); and on
#                  a simulated cluster of rate-limited namespaces, 4 ranks to
#                  4 TP workers (bench/cluster.sh; root only, else skipped);
#                  and over shm, to a worker whose model loads as an
#                  engine's loader does, the ranks writing where it reads
#                  in place vs through rings into staging (bench/inplace.sh)
# The output opens with a summary: each goal, its figure this run, the
# baseline it divides by, and whether it is met; the detail follows.
# Usage: bench/run.sh [--quick] [--json FILE]   (--quick: 256M and small N,
# under a minute; --json: the summary also as JSON, to compare and plot runs)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
json_out=
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --json) json_out=$(realpath -m "$2"); shift ;;
    *) echo "usage: bench/run.sh [--quick] [--json FILE]" >&2; exit 2 ;;
  esac
  shift
done
if [ $quick = 1 ]; then size=256M; counts="1000 10000"; sizes="64M 256M"; fresh=3
else size=1G; counts="1000 10000 40000 65000 100000"; sizes="64M 256M 1G 4G"; fresh=5; fi
. bench/common.sh
bazel build -c opt //bench:socket_baseline //bench:pipeline_baseline //bench:adopt_baseline \
  //bench:onecopy_baseline 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
py=.venv/bin/python
ratio() { echo "$1 / $2" | bc -l | xargs printf "%.2f"; }
# The goals go to a summary printed before the detail, which is kept aside
# until the end (stdout: fd 3 meanwhile).
export WTX_BENCH_GOALS="$tmp/goals.tsv"
: >"$WTX_BENCH_GOALS"
exec 3>&1 >"$tmp/detail.txt"
# A run that fails partway still shows what it measured, and why it stopped.
trap 'rc=$?; if [ $rc -ne 0 ]; then exec 1>&3; cat "$tmp/detail.txt";
      echo "bench/run.sh: stopped (exit $rc); the detail so far is above" >&2; fi; bench_cleanup' EXIT

echo "# wtx benchmark  $(date -u +%F)  $(nproc) cores  $(free -g | awk '/Mem:/ {print $2}') GiB  quick=$quick"
echo "baseline memcpy: fresh $base GB/s, warm $base_warm GB/s, warm in 256 KiB pieces $base_pieces GB/s"
echo "baseline the trainer's pack, one thread, 256 KiB pieces into a 4 x 4 MiB ring: $pack GB/s;" \
  "hashed while copied ($pack_kernel kernel, as the engine does) $pack_hashed GB/s;" \
  "each piece hashed after its copy, from L2 (two passes) $pack_twopass GB/s"
sock=$("$bin/bench/socket_baseline" "$bytes" | awk '{print $2}')
sock_lowat=$("$bin/bench/socket_baseline" "$bytes" lowat | awk '{print $2}')
echo "baseline loopback TCP stream: $sock GB/s; with its receiver woken a MiB at a time (SO_RCVLOWAT," \
  "as the tcp worker asks): $sock_lowat GB/s"
chain3=$("$bin/bench/socket_baseline" "$bytes" chain 3 | awk '{print $2}')
echo "baseline the tcp chain's shape in plain C (a sender, two relays that read a MiB and write it on," \
  "a last receiver; a thread each): $chain3 GB/s to each = $(ratio "$chain3" "$sock") x the one stream"
chain3s=$("$bin/bench/socket_baseline" "$bytes" chain 3 splice | awk '{print $2}')
echo "baseline the same chain with relays that splice the stream through pipes (the kernel copies each" \
  "byte once on a relay, not twice): $chain3s GB/s to each = $(ratio "$chain3s" "$sock") x the one stream"
sock_model=$("$bin/bench/socket_baseline" "$bytes" lowat model | awk '{print $2}')
chain3m=$("$bin/bench/socket_baseline" "$bytes" chain 3 model | awk '{print $2}')
echo "baseline the stream woken a MiB at a time and the read-and-write chain again, sent from and received" \
  "into memory of the model's size (each side's own, reused), as wtx's bytes go, unhashed:" \
  "$sock_model GB/s = $(ratio "$sock_model" "$sock_lowat") x the stream from cache;" \
  "the chain $chain3m GB/s to each = $(ratio "$chain3m" "$sock_model") x that stream"
pipe=$("$bin/bench/pipeline_baseline" "$bytes" | awk '{print $2}')
echo "baseline two copies pipelined through a 4 x 4 MiB ring, one process: $pipe GB/s"
adopt=$("$bin/bench/adopt_baseline" "$bytes" | awk '{print $2}')
echo "baseline one copy into a sealed memfd per 4 MiB chunk, mapped and hashed, one process: $adopt GB/s"
read -r onecopy onecopy_off < <("$bin/bench/onecopy_baseline" "$bytes" | awk '{print $3, $5}')
echo "baseline one copy from the trainer's memory (shared), per 4 MiB chunk, two threads, one process:" \
  "$onecopy GB/s with checksums (both sides hash), $onecopy_off GB/s without"

echo
echo "## control plane: one sync of N tiny tensors vs one JSON POST of the same metadata"
echo "# first: a trainer's first sync to a fresh worker, which sends every ParamMeta,"
echo "# the median of $fresh such (one alone swung by half between runs);"
echo "# steady: the best of a trainer's syncs 2-8 (wtx push --repeat 8), which"
echo "# name tensors by position in the worker's table (UpdateInfo.layout), as every"
echo "# RL step after the first does; per process: the best of three syncs from a"
echo "# trainer process each (runs A-W's steady state, where every sync is its"
echo "# process's first); JSON POST: the best of seven from one client process"
printf "%-8s %10s %10s %12s %12s %12s %12s %12s\n" N "first s" "steady s" "per process" \
  "JSON POST s" "JSON/first" "JSON/steady" "JSON/per pr."
json=$($py bench/json_baseline.py $counts)
for n in $counts; do
  $py bench/tiny_model.py "$n" "$tmp/tiny$n.safetensors"
  first=$(for f in $(seq "$fresh"); do
    start_worker 0 "cp$n-$f"
    "$bin/client/wtx" push --workers "$addr" --buffer-size 64M "$tmp/tiny$n.safetensors" | sync_s
    kill "${pids[-1]}" 2>/dev/null || true
  done | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
  start_worker 0 "cp$n"
  all=$("$bin/client/wtx" push --workers "$addr" --buffer-size 64M --repeat 8 \
    "$tmp/tiny$n.safetensors" | sync_s_all)
  best=$(echo "$all" | tail -n +2 | sort -g | head -1)  # the JSON POST's statistic too
  proc=$(for _ in 1 2 3; do
    "$bin/client/wtx" push --workers "$addr" --buffer-size 64M "$tmp/tiny$n.safetensors" | sync_s
  done | sort -g | head -1)
  j=$(echo "$json" | awk -v n="$n" '$2 == n {print $3}')
  printf "%-8s %10s %10s %12s %12s %12s %12s %12s\n" "$n" "$first" "$best" "$proc" "$j" \
    "$(ratio "$j" "$first")" "$(ratio "$j" "$best")" "$(ratio "$j" "$proc")"
  cp_first=$(ratio "$j" "$first"); cp_steady=$(ratio "$j" "$best"); cp_n=$n
  kill "${pids[-1]}" 2>/dev/null || true
done
goal "control plane, $cp_n tiny tensors, steady sync: speed vs JSON POST" "$cp_steady" \
  "vLLM-style JSON POST of the metadata" ge 1
goal "control plane, $cp_n tiny tensors, first sync: speed vs JSON POST" "$cp_first" \
  "vLLM-style JSON POST of the metadata" ge 1
n=$(echo $counts | awk '{print ($NF >= 40000) ? 40000 : $NF}')
[ -f "$tmp/tiny$n.safetensors" ] || $py bench/tiny_model.py "$n" "$tmp/tiny$n.safetensors"
start_worker 0 "e2e"
for _ in 1 2; do "$bin/client/wtx" push --workers "$addr" "$tmp/tiny$n.safetensors" >/dev/null; done
# Seven pushes, each its own process, and their median: one figure of a
# process this short is mostly noise on a shared VM (fifteen pushes of one
# build took 64-96 ms in one A/B: bench/ab.sh OLD --tiny 40000 --wall
# --rounds 15).
mapfile -t e2e < <(for _ in 1 2 3 4 5 6 7; do
  w0=$(date +%s%N)
  "$bin/client/wtx" push --workers "$addr" "$tmp/tiny$n.safetensors" >/dev/null
  echo $(( ($(date +%s%N) - w0) / 1000000 ))
done | sort -n)
echo "wtx push of $n tiny tensors, end to end (process start to exit, steady state):" \
  "median ${e2e[3]} ms of 7 (${e2e[0]}-${e2e[6]} ms)"
kill "${pids[-1]}" 2>/dev/null || true
if [ $quick = 0 ]; then
  echo "the same $n tiny tensors from the Python package, and into a Python host (bench/python_push.sh --tiny $n):"
  bench/python_push.sh --tiny "$n" 2>/dev/null | tail -5 | sed 's/^/  /'
fi
echo
echo "## data plane, size $size, steady state: the best of syncs 3-5 of one trainer"
echo "# (wtx push --repeat 5), as a training loop makes them; 'per process': the"
echo "# best of three syncs from a trainer process each (runs A-W's method) to the"
echo "# worker the rows above left in its steady state"
start_worker 0 a; w1=$addr; w1pid=${pids[-1]}
start_worker 0 b; w3="$w1,$addr"; w3pids="$w1pid ${pids[-1]}"
start_worker 0 c; w3="$w3,$addr"; w3pids="$w3pids ${pids[-1]}"
max() { sort -g | tail -1; }
row() {  # LABEL WORKERS GB/S BACKEND
  local ref=$base_warm; [ "$4" = tcp ] && ref=$sock
  printf "%-18s %-8s %10s %14s %14s  (delivered %.2f GB/s)\n" "$1" "$2" "$3" \
    "$(ratio "$3" "$base_warm")" "$(ratio "$3" "$ref")" "$(echo "$3 * $2" | bc -l)"
}
printf "%-18s %-8s %10s %14s %14s\n" backend workers "GB/s" "x warm memcpy" "x baseline"
for backend in shm tcp; do
  for set in "1 $w1" "3 $w3"; do
    n=${set%% *}; ws=${set#* }
    g=$("$bin/client/wtx" push --workers "$ws" --backend "$backend" --repeat 5 "synthetic:$size" |
      gbps_all | tail -3 | max)
    [ "$backend$n" = shm1 ] && shm1=$g
    [ "$backend$n" = shm3 ] && shm3=$g
    [ "$backend$n" = tcp1 ] && tcp1=$g
    [ "$backend$n" = tcp3 ] && tcp3=$g
    row "$backend" "$n" "$g" "$backend"
  done
done
g=$(for _ in 1 2 3; do "$bin/client/wtx" push --workers "$w1" --backend shm "synthetic:$size"; done |
  gbps_all | max)
row "shm (per process)" 1 "$g" shm

echo "tcp, 1 worker: $tcp1 GB/s = $(ratio "$tcp1" "$sock_lowat") x the stream whose receiver is woken a MiB at a time"
echo "tcp, 1 worker: $tcp1 GB/s = $(ratio "$tcp1" "$sock_model") x that stream from and into model-sized memory"
echo "tcp, chain of 3: $(ratio "$tcp3" "$tcp1") x one worker's rate; plain C's chain $(ratio "$chain3" "$sock") x its" \
  "one stream; wtx's chain $(ratio "$tcp3" "$chain3") x plain C's"
echo "tcp, chain of 3, in model-sized memory: plain C's chain $(ratio "$chain3m" "$tcp1") x wtx's one worker;" \
  "wtx's chain $(ratio "$tcp3" "$chain3m") x plain C's"
echo "shm, 1 worker: $shm1 GB/s = $(ratio "$shm1" "$adopt") x a one-copy design that adopts sealed pages"
echo "shm, 1 worker: $shm1 GB/s = $(ratio "$shm1" "$onecopy") x a one-copy design copying from shared tensors;" \
  "that design runs at $(ratio "$onecopy" "$base_warm") x the warm memcpy"
goal "shm, 1 worker, steady sync: rate vs a warm memcpy" "$(ratio "$shm1" "$base_warm")" \
  "warm memcpy of the model" ge 0.7
goal "shm, 3 workers: bytes delivered vs 1 worker's" "$(ratio "3 * $shm3" "$shm1")" \
  "the same sync to 1 worker" ge 1.5
goal "tcp, chain of 3: rate to each vs 1 worker's" "$(ratio "$tcp3" "$tcp1")" \
  "the same sync to 1 worker" ge 0.6
echo
echo "## checksums: shm and tcp, 1 worker, XXH3 on vs off (syncs 2-3 of a trainer, alternating; best of 2 trainers each)"
for backend in shm tcp; do
  on=; off=
  for _ in 1 2; do
    a=$("$bin/client/wtx" push --workers "$w1" --backend $backend --checksum --repeat 3 \
      "synthetic:$size" | sync_s_all | tail -2 | sort -g | head -1)
    b=$("$bin/client/wtx" push --workers "$w1" --backend $backend --no-checksum --repeat 3 \
      "synthetic:$size" | sync_s_all | tail -2 | sort -g | head -1)
    on=$(echo "${on:-$a} $a" | awk '{print ($1 < $2) ? $1 : $2}')
    off=$(echo "${off:-$b} $b" | awk '{print ($1 < $2) ? $1 : $2}')
  done
  echo "$backend: on ${on} s, off ${off} s: on / off = $(ratio "$on" "$off")"
  [ $backend = shm ] && shm_off=$off
done
echo "the trainer's pack alone (baseline above): hashed / plain = $(ratio "$pack" "$pack_hashed")," \
  "what checksums add where that one thread is a sync's critical path" \
  "(two passes: $(ratio "$pack" "$pack_twopass"))"
g=$(echo "$bytes / $shm_off / 1000000000" | bc -l | xargs printf "%.2f")
echo "shm, checksums off: $g GB/s = $(ratio "$g" "$pipe") x the two-copy pipeline baseline"

echo
echo "## CPU per sync, $size, one trainer's syncs 2-5: the shortest sync the cores allow"
# The trainer's from its own count (wtx push --repeat: getrusage around
# syncs 2-5); the workers' from /proc (utime + stime, summed over them)
# around that push less around a push of one sync, which leaves out each
# trainer's first sync. floor: the CPU of all of them over nproc, the
# shortest sync these cores allow for that work however it is scheduled.
# cpu_row BACKEND N ADDRS PIDS: prints the row, sets best_s, med_s and floor_s.
cpu_row() {
  local t0 t1 t2 out cw ct
  # shellcheck disable=SC2086 # PIDS: one word each
  t0=$(cpu_ticks $4)
  "$bin/client/wtx" push --workers "$3" --backend "$1" "synthetic:$size" >/dev/null
  t1=$(cpu_ticks $4)
  out=$("$bin/client/wtx" push --workers "$3" --backend "$1" --repeat 5 "synthetic:$size")
  t2=$(cpu_ticks $4)
  cw=$(echo "($t2 - $t1 - ($t1 - $t0)) / $(getconf CLK_TCK) / 4" | bc -l)
  ct=$(echo "$out" | sed -nE 's/.*its CPU ([0-9.e-]+) s per sync/\1/p')
  read -r best_s med_s < <(echo "$out" |
    sed -nE 's/^syncs 2-5 of this trainer: best ([0-9.e-]+) s, median ([0-9.e-]+) s.*/\1 \2/p')
  floor_s=$(echo "($cw + $ct) / $(nproc)" | bc -l)
  printf "%-8s %-8s %10.3f %10.3f %10.3f %10.3f %10.3f %14.2f\n" "$1" "$2" "$cw" "$ct" "$floor_s" \
    "$best_s" "$med_s" "$(echo "$med_s / $floor_s" | bc -l)"
}
# The CPU is each sync's average, so the median sync is set against it.
printf "%-8s %-8s %10s %10s %10s %10s %10s %14s\n" backend workers "workers s" "trainer s" \
  "floor s" "best s" "median s" "median / floor"
cpu_row shm 1 "$w1" "$w1pid"; shm1_med=$med_s; shm1_floor=$floor_s
cpu_row shm 3 "$w3" "$w3pids"; shm3_floor=$floor_s
cpu_row tcp 1 "$w1" "$w1pid"; tcp1_med=$med_s
cpu_row tcp 3 "$w3" "$w3pids"; tcp3_floor=$floor_s
echo "# with $(nproc) cores, the CPU each side spends per byte caps these ratios (the goals in brackets):"
echo "shm, 1 worker: the floor is $(ratio "$bytes / $shm1_floor / 1000000000" "$base_warm") x a warm" \
  "memcpy of the bytes (0.7x)"
echo "shm, 3 workers: the floor allows at most $(ratio "3 * $shm1_med" "$shm3_floor") x the bytes per" \
  "second one worker's median sync delivers (1.5x)"
echo "tcp, chain of 3: the floor allows at most $(ratio "$tcp1_med" "$tcp3_floor") x the rate of one" \
  "worker's median sync (0.6x)"

echo
echo "## memory: peak RSS after the syncs above vs the model ($size)"
hwm=$(awk '/VmHWM/ {print $2}' /proc/"$w1pid"/status)
tr=$( { /usr/bin/time -f "%M" "$bin/client/wtx" push --workers "$w1" --backend shm "synthetic:$size" >/dev/null; } 2>&1 | tail -1)
echo "worker peak $((hwm / 1024)) MiB = $(ratio "$hwm * 1024" "$bytes") x model (bound: 2.1 + buffers)"
echo "trainer peak $((tr / 1024)) MiB = $(ratio "$tr * 1024" "$bytes") x model (bound: 1 + buffers: shm 4 x 4 MiB)"

echo
echo "## scaling: shm, 1 worker, a fresh worker per size, a trainer's third sync"
printf "%-6s %10s %12s\n" size "sync s" "s per GiB"
for s in $sizes; do
  start_worker 0 "s$s"
  t=$("$bin/client/wtx" push --workers "$addr" --backend shm --repeat 3 "synthetic:$s" |
    sync_s_all | tail -1)
  gib=$(numfmt --from=iec "$s" | awk '{print $1 / 1073741824}')
  printf "%-6s %10s %12s\n" "$s" "$t" "$(ratio "$t" "$gib")"
  kill "${pids[-1]}" 2>/dev/null || true
done

echo
echo "## tensor-parallel workers (bench/sharded.sh): each of two ranks vs a whole worker"
bench/sharded.sh "$size" | tail -n +2

echo
echo "## many senders (bench/many.sh): 4 trainer ranks vs rank 0 alone, loopback"
bench/many.sh "$size" | tail -n +2
echo
echo "## many senders over shm, one copy per byte (bench/inplace.sh): the ranks writing"
echo "# where a loader reads in place vs through rings into its staging"
bench/inplace.sh "$size" 3 | tail -n +2
echo
echo "## delta syncs (bench/delta.sh): each kind of change vs a full sync, same worker"
bench/delta.sh "$size" | tail -n +2
echo
if [ $quick = 0 ]; then
  echo "## the vLLM plugin, tensor-parallel size 2 vs 1 (bench/vllm_tp.sh)"
  bench/vllm_tp.sh 2>/dev/null | grep -E '^(model|shm|tcp)'
  echo
fi
echo "## many senders on a simulated cluster (bench/cluster.sh): links the limit"
if [ $quick = 1 ]; then bench/cluster.sh 32M; else bench/cluster.sh 128M; fi

echo
echo "## the baselines again, at the end of the run: each ratio above is only as"
echo "# steady as the baseline it divides by"
again=$("$bin/bench/memcpy_baseline" "$bytes")
sock_end=$("$bin/bench/socket_baseline" "$bytes" | awk '{print $2}')
warm_end=$(echo "$again" | awk '/warm/ {print $2}')
pack_end=$(echo "$again" | awk '/^pack_hashed_gbps/ {print $2}')
echo "warm memcpy: start $base_warm GB/s, end $warm_end GB/s;" \
  "loopback TCP stream: start $sock GB/s, end $sock_end GB/s;" \
  "the trainer's pack, hashed: start $pack_hashed GB/s, end $pack_end GB/s"
# A baseline whose start is far below its end (a slow stretch of the
# machine when it ran) makes every ratio over it look better than it is.
for b in "warm memcpy:$base_warm:$warm_end" "loopback TCP stream:$sock:$sock_end"; do
  IFS=: read -r name start end <<<"$b"
  if awk -v s="$start" -v e="$end" 'BEGIN {exit !(s < 0.8 * e)}'; then
    echo "WARNING: $name ran $(ratio "$end" "$start")x faster at the end than at the start:" \
      "the ratios above that divide by it overstate wtx; run the bench again"
  fi
done

# The summary first, then the detail.
exec 1>&3 3>&-
echo "# wtx benchmark summary  $(date -u +%F)  $(nproc) cores  quick=$quick"
printf "%-62s %10s  %-8s  %-9s %s\n" goal figure want result baseline
awk -F'\t' '{printf "%-62s %10s  %-8s  %-9s %s\n", $1, $2, $4, $5, $3}' "$WTX_BENCH_GOALS"
echo
cat "$tmp/detail.txt"
if [ -n "$json_out" ]; then
  python3 - "$WTX_BENCH_GOALS" "$json_out" "$quick" <<'PY'
import datetime, json, os, sys
goals = []
for line in open(sys.argv[1]):
    name, figure, baseline, want, result = line.rstrip("\n").split("\t")
    cmp, target = want.split(" ")
    goals.append({"goal": name, "figure": None if figure in ("", "n/a") else float(figure),
                  "baseline": baseline, "cmp": cmp, "want": float(target), "result": result})
json.dump({"date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
           "quick": sys.argv[3] == "1", "goals": goals}, open(sys.argv[2], "w"), indent=1)
PY
  echo "summary written to $json_out"
fi

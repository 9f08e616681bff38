#!/usr/bin/env bash
# The GPU checks, run on a GPU machine from the bundle (tests/gpu/bundle.sh
# builds it elsewhere; this machine needs no Bazel, apt or network). Every
# step runs under its own timeout, all of them in under 5 minutes, and ends
# PASS, FAIL or SKIP with the reason; the log goes to $OUT/device_check
# when OUT is set (the device tool's), else to ./device_check-out.
#   libs        libcudart and libnccl: the system's, CUDA's, or a torch
#               wheel's (site-packages/nvidia/...); a GPU without them FAILs
#   host        issue 11's data-plane goals on this machine's cores, CPU
#               only (shm and tcp, 1 and 3 workers, checksums on and off,
#               1 GB from one trainer), as ratios to a memcpy and a raw
#               loopback stream of the same run: reported, never asserted
#   gpu_test    the cuda_ipc test across processes (worker processes on
#               this GPU)
#   probe       every CUDA/NCCL call wtx makes; 200 rounds of cross-process
#               IPC with no stale read
#   throughput  2 GB over shm and cuda_ipc to 1 and 2 workers, and over
#               cuda_ipc to a model on the GPU (device staging; and direct,
#               one copy per byte, in 64 MiB chunks and in two: each chunk
#               costs a call and a wait), cuda_ipc from tensors on the trainer's
#               GPU (wtx push --on-gpu), against a cudaMemcpy device-to-
#               device copy of the same bytes, same run
#   many        2 trainer processes (FSDP halves of one model, wtx push
#               --world 2) to 2 tensor-parallel workers over cuda_ipc, each
#               rank writing its halves straight into the workers' receive
#               regions, against rank 0 alone to the same workers and a
#               cudaMemcpy device to device of the same bytes, same run
#   nccl        on one GPU: NCCL's own refusal ("Duplicate GPU"), not a hang
#               nor any other failure (with 2+ GPUs: a push)
# With --vllm, one step instead (under 3 minutes, its own run):
#   vllm        `vllm serve` of a tiny Llama with --weight-transfer-config
#               '{"backend": "wtx"}', a push through vLLM's HTTP client, the
#               version it reports (SKIP, saying why, where vllm, transformers
#               or grpcio are not installed: this machine has no network)
# Usage: device_check.sh [--double | --vllm]   (--double: the CUDA/NCCL
# TEST DOUBLE instead of a GPU, to prove the bundle on a machine without one)
set -uo pipefail
root=$(cd "$(dirname "$0")" && pwd)
double=0 only_vllm=0
[ "${1:-}" = "--double" ] && double=1
[ "${1:-}" = "--vllm" ] && only_vllm=1
out=${OUT:-$PWD/device_check-out}/device_check
mkdir -p "$out"
exec > >(tee "$out/summary.log") 2>&1
tee_pid=$!
pass=0 fail=0 skip=0
# finish: the summary line, then exit once tee has written everything to
# summary.log (it runs beside this shell: a reader of the log right after
# the exit, as the suite's bundle_test, could miss its last lines), waiting
# at most 10 s; the status is 0 when no step failed.
finish() {
  echo "device check: $pass passed, $fail failed, $skip skipped"
  exec >&- 2>&-
  for _ in $(seq 100); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
  [ "$fail" = 0 ]
  exit
}
say() { # RESULT STEP WHY
  printf '%-5s %-11s %s\n' "$1" "$2" "$3"
  case $1 in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; *) skip=$((skip + 1)) ;; esac
}
# run STEP SECONDS CMD...: the command's output in $out/STEP.log; 124 on timeout.
run() {
  local name=$1 secs=$2
  shift 2
  timeout -k 5 "$secs" "$@" >"$out/$name.log" 2>&1
}
tail_of() { tail -n "${2:-3}" "$out/$1.log" | tr '\n' ' '; }
echo "# wtx device check  $(date -u +%FT%TZ)  $(cat "$root/MANIFEST" 2>/dev/null | head -1)"
has_gpu=0
{ [ -e /dev/nvidiactl ] || [ -d /proc/driver/nvidia/gpus ]; } && has_gpu=1
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | tee "$out/gpus.log"

# ---- vllm ----
vllm_check() {
  local py=${WTX_DEVICE_PYTHON:-python3} port=18123 model=$out/tiny-llama pid
  "$py" - "$model" <<'PY' || return 1
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="$root/lib"
  VLLM_SERVER_DEV_MODE=1 "$py" -m vllm.entrypoints.openai.api_server --model "$model" \
    --port $port --gpu-memory-utilization 0.2 --max-model-len 256 --enforce-eager \
    --weight-transfer-config '{"backend": "wtx"}' >"$out/vllm-serve.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
  for _ in $(seq 150); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { tail -20 "$out/vllm-serve.log"; return 1; }
    sleep 1
  done
  "$py" - "$model" "http://127.0.0.1:$port" <<'PY'
import sys, requests, torch, wtx
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.plugins import load_general_plugins
load_general_plugins()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(0.5)
engine = WeightTransferTrainerFactory.trainer_init(
    wtx.WtxTrainerInitInfo(transport="shm", rank=0),
    client=HTTPVLLMWeightSyncClient(sys.argv[2]), source=ModuleSource(model))
engine.send_weights(version="device-check")
engine.shutdown()
v = requests.get(sys.argv[2] + "/weight_info").json()["weight_version"]
assert v == "device-check", v
print("vllm serve took a wtx push over shm; /weight_info says", v)
PY
}
export -f vllm_check
vllm_step() {
if [ $double = 1 ]; then
  say SKIP vllm "needs a real GPU (vllm serve cannot run on the double)"
elif [ ! -d "$root/python" ]; then
  say SKIP vllm "the bundle has no Python package (tests/gpu/bundle.sh adds it)"
elif ! why=$(PYTHONPATH="$root/python" LD_LIBRARY_PATH="$root/lib" ${WTX_DEVICE_PYTHON:-python3} \
               -c "import vllm, transformers, grpc, google.protobuf, requests, wtx" 2>&1); then
  say SKIP vllm "this machine's Python lacks what vllm serve needs: $(echo "$why" | tail -1)"
elif run vllm 170 bash -c vllm_check; then
  say PASS vllm "$(tail_of vllm 1)"
else
  say FAIL vllm "rc $?: $(tail_of vllm 3)"
fi
}


# ---- host ----
# Functions the timed steps run in a child bash (exported with their
# variables); workers die with the step.
start_worker() { # PORTFILE [DEVICE [BINARY [FLAGS]]]: sets addr
  rm -f "$1"
  WTX_CUDA_DEVICE=${2:-0} "${3:-$root/server/wtx-worker}" --listen 127.0.0.1:0 --port-file "$1" \
    --log-level warn ${4:-} >/dev/null 2>>"$out/workers.log" &
  pids+=($!)
  for _ in $(seq 300); do [ -s "$1" ] && break; sleep 0.1; done
  addr="127.0.0.1:$(cat "$1" 2>/dev/null)"
}
stop_workers() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
# Each row: the best of syncs 3-5 of one trainer (wtx push --repeat 5);
# the workers are started here and die with the step. Needs no GPU.
host_push() { # KEY BACKEND WORKERS [FLAGS]: sets hr[KEY] (GB/s)
  local key=$1 backend=$2 ws=$3
  shift 3
  hr[$key]=$("$root/client/wtx" push --workers "$ws" --backend "$backend" "$@" --repeat 5 \
    --timeout-ms 60000 "synthetic:$hsize" | sed -nE 's/.*\(([0-9.]+) GB\/s\).*/\1/p' |
    tail -3 | sort -g | tail -1)
  [ -n "${hr[$key]}" ]
}
host_goals() {
  local a b c bytes warm sock t0 t1 cpu_t cpu_w
  declare -A hr
  pids=()
  trap stop_workers EXIT
  bytes=$(numfmt --from=iec "$hsize")
  warm=$("$root/memcpy_baseline" "$bytes" | awk '/warm/ {print $2}')
  sock=$("$root/socket_baseline" "$bytes" | awk '{print $2}')
  [ -n "$warm" ] && [ -n "$sock" ] || return 1
  start_worker "$out/h0"; a=$addr
  start_worker "$out/h1"; b=$addr
  start_worker "$out/h2"; c=$addr
  host_push shm1 shm "$a" && host_push shm3 shm "$a,$b,$c" && host_push tcp1 tcp "$a" &&
    host_push tcp3 tcp "$a,$b,$c" && host_push shm1off shm "$a" --no-checksum &&
    host_push tcp1off tcp "$a" --no-checksum || return 1
  # CPU per sync, shm to one warm worker: the trainer's from --repeat's
  # line, the worker's from /proc over the same push (its first sync too).
  t0=$(awk '{print $14 + $15}' "/proc/${pids[0]}/stat")
  cpu_t=$("$root/client/wtx" push --workers "$a" --backend shm --repeat 5 --timeout-ms 60000 \
    "synthetic:$hsize" | sed -nE 's/.*its CPU ([0-9.e-]+) s per sync/\1/p')
  t1=$(awk '{print $14 + $15}' "/proc/${pids[0]}/stat")
  cpu_w=$(awk -v d=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.3f", d / hz / 5}')
  q() { awk -v a="$1" -v b="$2" -v m="${3:-1}" 'BEGIN {printf "%.2f", a * m / b}'; }
  echo "cores $(nproc), $hsize from one trainer: warm memcpy $warm GB/s, loopback TCP stream $sock GB/s"
  echo "shm, 1 worker: ${hr[shm1]} GB/s = $(q "${hr[shm1]}" "$warm") x the warm memcpy (goal 0.7)"
  echo "shm, 3 workers: $(q "${hr[shm3]}" "${hr[shm1]}" 3) x one worker's bytes per second (goal 1.5)"
  echo "tcp, 1 worker: ${hr[tcp1]} GB/s = $(q "${hr[tcp1]}" "$sock") x the raw stream (goal 0.8)"
  echo "tcp, chain of 3: $(q "${hr[tcp3]}" "${hr[tcp1]}") x one worker's rate (goal 0.6)"
  echo "checksums on/off: shm $(q "${hr[shm1off]}" "${hr[shm1]}"), tcp $(q "${hr[tcp1off]}" "${hr[tcp1]}") (goal 1.15)"
  echo "CPU per sync, shm to 1 worker: worker $cpu_w s, trainer ${cpu_t:-?} s"
}
host_step() {
  if run host 150 bash -c host_goals; then
    say PASS host "$(grep -E 'goal|CPU' "$out/host.log" | sed -E 's/ = / /; s/^([a-z]+, [^:]+): [0-9.]+ GB\/s/\1:/' | tr '\n' ';')"
  else
    say FAIL host "rc $?: $(tail_of host 3)"
  fi
}
hsize=1G
[ $double = 1 ] && hsize=256M  # the suite's proof of the bundle, on a small machine
export hsize
export -f start_worker stop_workers host_push host_goals

# ---- libs ----
candidates() { # NAME: every file of that library on this machine, best first
  local roots=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib
               /usr/lib/x86_64-linux-gnu /usr/lib64)
  local py
  for py in python3 python; do
    command -v "$py" >/dev/null || continue
    roots+=($("$py" -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null))
    break
  done
  for r in "${roots[@]}"; do
    [ -d "$r" ] && timeout 20 find "$r" -maxdepth 6 -name "$1.so*" -type f 2>/dev/null
  done | sort -r -V | awk '!seen[$0]++'
}
cudart="" nccl=""
if [ $double = 1 ]; then
  cudart=$root/cuda/testing/libwtx_fake_cuda.so nccl=$cudart
  say PASS libs "the CUDA/NCCL TEST DOUBLE (--double): nothing here ran on a GPU"
else
  # The first runtime that answers (a CUDA 13 runtime needs a recent driver).
  for c in ${WTX_GPU_CUDART:-} $(candidates libcudart); do
    if WTX_CUDART_LIB=$c run libs-try 30 "$root/probe" d2d 1048576; then cudart=$c; break; fi
  done
  for n in ${WTX_GPU_NCCL:-} $(candidates libnccl); do nccl=$n; break; done
  if [ -z "$cudart" ] && [ $has_gpu = 1 ]; then
    say FAIL libs "this machine has an NVIDIA GPU but no usable libcudart ($(candidates libcudart | tr '\n' ' '))"
  elif [ -z "$cudart" ]; then
    say SKIP libs "no NVIDIA GPU and no CUDA runtime here; every step skipped"
  else
    say PASS libs "cudart $cudart; nccl ${nccl:-none found}"
  fi
fi
export WTX_CUDART_LIB=$cudart WTX_NCCL_LIB=$nccl WTX_GPU_CUDART=$cudart WTX_GPU_NCCL=$nccl
export root out
[ $only_vllm = 1 ] && [ -n "$cudart" ] && { vllm_step; finish; }
[ $only_vllm = 1 ] || host_step
if [ -z "$cudart" ]; then
  for s in gpu_test probe throughput nccl vllm; do say SKIP "$s" "no CUDA runtime"; done
  finish
fi

# ---- gpu_test ----
if (cd "$root" && run gpu_test 100 ./gpu_test --gtest_filter='*cuda_ipc*'); then
  if grep -q '^\[  SKIPPED \]' "$out/gpu_test.log"; then say SKIP gpu_test "$(tail_of gpu_test 4)"
  else say PASS gpu_test "$(grep -c '^\[       OK \]' "$out/gpu_test.log") test(s): $(grep '^\[       OK \]' "$out/gpu_test.log" | sed 's/.*\] //' | tr '\n' ' ')"; fi
else
  say FAIL gpu_test "rc $? (124: timeout): $(grep -E 'Failure|FAILED|rror' "$out/gpu_test.log" | head -3 | tr '\n' ' ')"
fi

# ---- probe ----
if run probe-calls 40 "$root/probe" calls; then say PASS probe "$(tail_of probe-calls 1)"
else say FAIL probe "rc $?: $(tail_of probe-calls 3)"; fi
if run probe-ipc 50 "$root/probe" ipc 200; then say PASS probe "$(tail_of probe-ipc 1)"
else say FAIL probe "rc $?: $(tail_of probe-ipc 3)"; fi

# ---- throughput ----
size=2G half=1G
[ $double = 1 ] && size=256M half=128M  # the double copies through host memory
throughput() {
  local a b g base line r backend n ws label flags row
  pids=()
  trap stop_workers EXIT
  start_worker "$out/p0"; a=$addr
  start_worker "$out/p1"; b=$addr
  # A model on the GPU (device staging), as vLLM's: tests/client/gpu_model_worker.
  start_worker "$out/p3" 0 "$root/tests/client/gpu_model_worker" --no-check; g=$addr
  base=$("$root/probe" d2d "$(numfmt --from=iec "$size")" | awk '/d2d/ {print $2}')
  [ -n "$base" ] || return 1
  echo "baseline: cudaMemcpy device to device of $size: $base GB/s"
  # BACKEND WORKERS ADDRESSES LABEL [FLAGS]: the trainer's tensors are on
  # its GPU (--on-gpu) for cuda_ipc, as a training job's are; in host
  # memory for shm.
  local rows=("shm 1 $a host" "shm 2 $a,$b host" "cuda_ipc 1 $a trainer-gpu --on-gpu"
              "cuda_ipc 2 $a,$b trainer-gpu --on-gpu"
              "cuda_ipc 1 $g model-on-gpu --on-gpu"
              "cuda_ipc 1 $g model-on-gpu,direct --on-gpu --direct"
              "cuda_ipc 1 $g model-on-gpu,direct,2-chunks --on-gpu --direct --buffer-size $half")
  for row in "${rows[@]}"; do
    read -r backend n ws label flags <<<"$row"
    for _ in 1 2; do "$root/client/wtx" push --workers "$ws" --backend "$backend" $flags \
      --timeout-ms 60000 "synthetic:$size" >/dev/null || return 1; done
    line=$("$root/client/wtx" push --workers "$ws" --backend "$backend" $flags \
           --timeout-ms 60000 "synthetic:$size") || return 1
    r=$(echo "$line" | sed -nE 's/.*\(([0-9.]+) GB\/s\).*/\1/p' | tail -1)
    printf '%-9s %s worker(s), %s: %6s GB/s = %s x d2d  (%s)\n' "$backend" "$n" "$label" \
      "$r" "$(echo "$r $base" | awk '{printf "%.2f", $1 / $2}')" "$line"
  done
}
# many: 2 ranks to 2 TP workers over cuda_ipc, then rank 0 alone; the
# third sync of each, and the bytes every worker holds checked by the
# workers' own checksums (on: span sums from each rank).
many_check() {
  local a b base p0 p1 ranks r one two
  pids=()
  trap stop_workers EXIT
  echo '* dim 0' >"$out/rules"
  start_worker "$out/m0" 0 "$root/server/wtx-worker" "--shard-rules $out/rules --tp-rank 0 --tp-size 2"; a=$addr
  start_worker "$out/m1" 0 "$root/server/wtx-worker" "--shard-rules $out/rules --tp-rank 1 --tp-size 2"; b=$addr
  base=$("$root/probe" d2d "$(numfmt --from=iec "$size")" | awk '/d2d/ {print $2}')
  [ -n "$base" ] || return 1
  p0=$((20000 + RANDOM % 10000)); p1=$((p0 + 1))
  ranks=127.0.0.1:$p0,127.0.0.1:$p1
  for r in 0 1; do
    WTX_SESSION_TOKEN=device-check-many-session "$root/client/wtx" push --workers "$a,$b" \
      --backend cuda_ipc --checksum --world 2 --rank $r --rank-addresses "$ranks" --repeat 3 \
      --timeout-ms 60000 "synthetic:$size" >"$out/many$r.out" 2>&1 &
    pids+=($!)
  done
  wait "${pids[-1]}" && wait "${pids[-2]}" || { cat "$out"/many*.out; return 1; }
  one=$(grep -c '^pushed' "$out/many0.out"); two=$(grep -c '^pushed' "$out/many1.out")
  [ "$one" = 3 ] && [ "$two" = 3 ] || { cat "$out"/many*.out; return 1; }
  "$root/client/wtx" push --workers "$a,$b" --backend cuda_ipc --checksum --repeat 3 \
    --timeout-ms 60000 "synthetic:$size" >"$out/alone.out" 2>&1 || { cat "$out/alone.out"; return 1; }
  r=$(sed -nE 's/^pushed .* in ([0-9.]+) s.*/\1/p' "$out/many0.out" | tail -1)
  one=$(sed -nE 's/^pushed .* in ([0-9.]+) s.*/\1/p' "$out/alone.out" | tail -1)
  echo "2 ranks to 2 TP workers: $r s; rank 0 alone: $one s ($(echo "$one $r" |
    awk '{printf "%.2f", $1 / $2}') x); d2d copy of $size at $base GB/s takes $(echo \
    "$size $base" | numfmt --from=iec --field 1 | awk '{printf "%.3f", $1 / $2 / 1e9}') s"
}
nccl_check() {
  local dev=0
  pids=()
  trap stop_workers EXIT
  [ "$gpus" -ge 2 ] && dev=1
  start_worker "$out/p2" "$dev"
  WTX_CUDA_DEVICE=0 "$root/client/wtx" push --workers "$addr" --backend nccl \
    --timeout-ms 30000 synthetic:64M
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ $double = 1 ] && gpus=1  # the double: every rank on device 0
export root out size half gpus
export -f throughput many_check nccl_check
if run throughput 100 bash -c throughput; then
  say PASS throughput "$(grep -E 'x d2d|baseline' "$out/throughput.log" | sed 's/  (.*//' | tr '\n' ';')"
else
  say FAIL throughput "rc $?: $(tail_of throughput 3)"
fi

# ---- many ----
if run many 90 bash -c many_check; then
  say PASS many "$(tail_of many 1)"
else
  say FAIL many "rc $?: $(tail_of many 3)"
fi

# ---- nccl ----
run nccl 60 bash -c nccl_check
rc=$?
if [ "$gpus" -ge 2 ]; then
  if [ $rc = 0 ]; then say PASS nccl "trainer on GPU 0, worker on GPU 1: $(tail_of nccl 1)"
  else say FAIL nccl "rc $rc: $(tail_of nccl 2)"; fi
elif [ $rc = 124 ] || [ $rc = 137 ]; then
  say FAIL nccl "one GPU: the push hung until the step's timeout"
elif [ $rc = 0 ]; then
  say FAIL nccl "one GPU: two ranks on one GPU succeeded, which NCCL refuses"
elif grep -q "Duplicate GPU" "$out/nccl.log"; then
  say PASS nccl "one GPU: NCCL's own refusal, in time: $(grep -oE 'nccl: [^;]*' "$out/nccl.log" | head -1)"
else
  # Any other failure (libnccl missing, a crash) is not the refusal asked for.
  say FAIL nccl "one GPU: rc $rc, but not NCCL's refusal of two ranks on one GPU: $(tail_of nccl 2)"
fi

finish

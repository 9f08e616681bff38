#!/usr/bin/env bash
# A/B of two revisions of the Python package (python/src/wtx) in one run,
# as bench/ab.sh is for the C side: the C library, worker and CLI are the
# working tree's; each side's package is its revision's. ROUNDS processes
# of bench/python_push.py --tiny per side, alternating, each timing SYNCS
# steady syncs of N tiny tensors from a TorchModuleSource into a C worker
# (trainer), from the C CLI into a wtx.serve host with load_weights
# (host), and into one whose load_weights only walks its items (walking:
# wtx's own part). Prints every sync's seconds, and each side's mean,
# median, p90 and best.
# Usage: bench/python_ab.sh OLD [NEW] [--tiny 40000] [--each 4] [--rounds 3] [--syncs 10] [--no-gc]
#   --each E: the N tensors are F32 [E] (20480: 80 KB, each a tensor of
#        its own on the host, as an MoE model's experts are)
#   NEW: a revision, or the working tree when left out. Both revisions'
#        _capi.py must match the working tree's C API (tests/python's ABI
#        check): an older package against a newer libwtx is not a test.
#   --no-gc: the new side runs with Python's garbage collector off
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1; shift
new=
[ $# -gt 0 ] && [ "${1#-}" = "$1" ] && { new=$1; shift; }
tiny=40000 each=4 rounds=3 syncs=10 nogc=
while [ $# -gt 0 ]; do
  case $1 in
    --tiny) tiny=$2; shift 2 ;;
    --each) each=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --syncs) syncs=$2; shift 2 ;;
    --no-gc) nogc=1; shift ;;
    *) echo "bench/python_ab.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
scripts/setup.sh >/dev/null
bazel build -c opt //lib:libwtx.so //server:wtx-worker //client:wtx 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
# package SIDE REV: the package of REV (the working tree when empty) in
# $tmp/SIDE, with stubs generated from the working tree's proto/.
package() {
  mkdir -p "$tmp/$1"
  if [ -n "$2" ]; then
    git archive "$2" python/src/wtx | tar -x -C "$tmp/$1"
    mv "$tmp/$1/python/src/wtx" "$tmp/$1/wtx"
    rm -rf "$tmp/$1/python"
  else
    cp -r python/src/wtx "$tmp/$1/"
  fi
  rm -rf "$tmp/$1/wtx/v1" "$tmp/$1/wtx/_lib"
  .venv/bin/python -c "import sys, pathlib; sys.path.insert(0, 'python/build_backend'); \
import wtx_build; wtx_build.generate_stubs(pathlib.Path('proto').resolve(), pathlib.Path('$tmp/$1'))"
}
package old "$old"
package new "$new"
.venv/bin/python bench/tiny_model.py "$tiny" "$tmp/tiny.safetensors" "$each"
for w in 1 2; do
  "$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/port$w" --log-level warn &
  pids+=($!)
done
for _ in $(seq 200); do [ -s "$tmp/port1" ] && [ -s "$tmp/port2" ] && break; sleep 0.05; done
for _ in $(seq "$rounds"); do
  for side in old new; do
    g=; [ "$side" = new ] && g=$nogc
    WTX_BENCH_RAW=1 WTX_BENCH_SYNCS="$syncs" WTX_BENCH_NO_GC="$g" WTX_LIBWTX="$bin/lib/libwtx.so" \
      PYTHONPATH="$tmp/$side" .venv/bin/python bench/python_push.py \
      "127.0.0.1:$(cat "$tmp/port1")" "127.0.0.1:$(cat "$tmp/port2")" "$bin/client/wtx" \
      tiny "$tiny" "$tmp/tiny.safetensors" "$each" 2>/dev/null | sed -n "s/^raw /$side /p"
  done
done >"$tmp/raw"
echo "# $tiny tensors of F32 [$each], $rounds processes per side of $syncs syncs each, alternating${nogc:+; new: gc off}"
.venv/bin/python - "$tmp/raw" "$old" "${new:-working tree}" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
for side, rev in (("old", sys.argv[2]), ("new", sys.argv[3])):
    for what in ("trainer:", "host:", "walking:"):
        v = [float(x) for r in rows if r[:2] == [side, what] for x in r[2:]]
        p90 = sorted(v)[len(v) * 9 // 10]
        print(f"{side} ({rev}) {what} mean {statistics.mean(v):.4f} s, median "
              f"{statistics.median(v):.4f} s, p90 {p90:.4f} s, best {min(v):.4f} s:",
              " ".join(f"{x:.4f}" for x in v))
PY

#!/usr/bin/env bash
# The Python package against the C CLI, same bytes, same worker kind, same
# run: bench/python_push.sh [BYTES | --tiny N [--each E]] (default 1 GiB;
# --tiny N: N tiny tensors, the control plane; --each E: N tensors of E F32
# each instead of 4, e.g. --tiny 10000 --each 20480 for 10k of 80 KB, each
# a tensor of its own on the host as an MoE model's experts are).
set -euo pipefail
cd "$(dirname "$0")/.."
what=(${1:-1073741824})
[ "${1:-}" = --tiny ] && what=(tiny "$2" "${4:-4}")
[ "${1:-}" = --tiny ] && [ -n "${3:-}" ] && [ "$3" != --each ] && { echo "bench/python_push.sh: unknown argument $3" >&2; exit 2; }
bazel build -c opt //lib:libwtx.so //server:wtx-worker //client:wtx 2>&1 | grep -E '^(ERROR|FAILED)' && exit 1
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
trap 'kill $pid $pid2 2>/dev/null || true; rm -rf "$tmp"' EXIT
cp -r python/src/wtx "$tmp/"
rm -rf "$tmp/wtx/v1" "$tmp/wtx/_lib"
.venv/bin/python -c "import sys, pathlib; sys.path.insert(0, 'python/build_backend'); import wtx_build; \
wtx_build.generate_stubs(pathlib.Path('proto').resolve(), pathlib.Path('$tmp'))"
"$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/port" --log-level warn &
pid=$!
"$bin/server/wtx-worker" --listen 127.0.0.1:0 --port-file "$tmp/port2" --log-level warn &
pid2=$!
[ "${what[0]}" = tiny ] && .venv/bin/python bench/tiny_model.py "${what[1]}" "$tmp/tiny.safetensors" "${what[2]}"
for _ in $(seq 200); do [ -s "$tmp/port" ] && [ -s "$tmp/port2" ] && break; sleep 0.05; done
args=("${what[@]}")
[ "${what[0]}" = tiny ] && args=(tiny "${what[1]}" "$tmp/tiny.safetensors" "${what[2]}")
WTX_LIBWTX="$bin/lib/libwtx.so" PYTHONPATH="$tmp" .venv/bin/python bench/python_push.py \
  "127.0.0.1:$(cat "$tmp/port")" "127.0.0.1:$(cat "$tmp/port2")" "$bin/client/wtx" "${args[@]}"

#!/usr/bin/env bash
# pip install ./python into a fresh venv, as the README says, then use it:
# python -m wtx push of a safetensors file to a wtx-worker, python -m wtx
# info. libwtx.so comes from this build (WTX_LIBWTX: Bazel does not run
# inside a test); everything else as a user gets it, from PyPI (pip's cache
# is used when there is one). Prints how long the install took.
set -euo pipefail
tmp=${TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$tmp/repo"
cp -rL python proto "$tmp/repo/"
export WTX_LIBWTX="$PWD/lib/libwtx.so"
home=$(getent passwd "$(id -u)" | cut -d: -f6)
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$home/.cache/pip}
python3 -m venv "$tmp/venv"
t0=$(date +%s.%N)
"$tmp/venv/bin/pip" install -q --disable-pip-version-check "$tmp/repo/python"
echo "install: $(echo "$(date +%s.%N) - $t0" | bc | xargs printf '%.1f') s into a fresh venv"
py=$tmp/venv/bin/python
# A worker, and a small safetensors file written by hand (no numpy here).
server/wtx-worker --listen 127.0.0.1:0 --port-file "$tmp/port" --log-level warn &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 200); do [ -s "$tmp/port" ] && break; sleep 0.05; done
"$py" - "$tmp/m.safetensors" <<'PY'
import json, struct, sys
data = bytes(range(64))
h = json.dumps({"w": {"dtype": "U8", "shape": [8, 8], "data_offsets": [0, 64]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + data)
PY
addr="127.0.0.1:$(cat "$tmp/port")"
(cd "$tmp" && "$py" -m wtx push --workers "$addr" --version from-pip m.safetensors)
(cd "$tmp" && "$py" -m wtx info "$addr") | tee "$tmp/info.json"
grep -q '"weight_version": "from-pip"' "$tmp/info.json"
"$py" -c "import wtx, wtx.v1.weight_transfer_pb2_grpc; print('import ok', wtx.__version__)"

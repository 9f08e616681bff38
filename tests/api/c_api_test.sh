#!/usr/bin/env bash
# The public C API as a binding holds it:
#  1. every wtx_ name README's C sketch uses is one examples/trainer.c uses;
#  2. it compiles with -Werror against include/ and links against libwtx.so,
#     nothing else (no protobuf-c or gRPC header is on the include path);
#  3. libwtx.so exports exactly the functions the public headers declare;
#  4. run against a real wtx-worker, it publishes what it read.
set -euo pipefail
tmp=$(mktemp -d)
wpid=
cleanup() {
  [ -n "$wpid" ] && kill "$wpid" 2>/dev/null && wait "$wpid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. The README's C block (its quick start), against the whole example.
awk '/^```c$/ {c=1; next} c && /^```$/ {exit} c {print}' README.md >"$tmp/readme.c"
[ -s "$tmp/readme.c" ] || fail "README has no C block"
for name in $(grep -oE '\bwtx_[a-z0-9_]+|\bWTX_[A-Z0-9_]+' "$tmp/readme.c" | sort -u); do
  grep -q "\b$name\b" examples/trainer.c || fail "README's C sketch uses $name, which examples/trainer.c does not"
done

# 2. Built the way a binding's user builds it (under --config=asan the
#    library needs the sanitizer runtime first, so the example gets it too).
san=
# (grep reads all of ldd's output: with -q and pipefail, ldd could die of SIGPIPE.)
if ldd lib/libwtx.so | grep libasan >/dev/null; then san=-fsanitize=address,undefined; fi
cc -std=c17 -Wall -Wextra -Werror $san -Iinclude examples/trainer.c -Llib -l:libwtx.so \
  -Wl,-rpath,"$PWD/lib" -o "$tmp/trainer" || fail "examples/trainer.c does not build"

# 3. Exports: the version script's list (generated from the headers) and
#    nothing more.
nm -D --defined-only lib/libwtx.so | awk '{print $3}' | sort >"$tmp/exported"
sed -nE 's/^    (wtx_[a-z0-9_]+);$/\1/p' lib/libwtx.map | sort >"$tmp/declared"
[ -s "$tmp/declared" ] || fail "no declared export"
diff -u "$tmp/declared" "$tmp/exported" >&2 || fail "libwtx.so exports differ from the public headers"
grep -q '^wtx_trainer_send_weights$' "$tmp/exported" || fail "wtx_trainer_send_weights not exported"

# 4. A one-tensor safetensors file: F32 [4] = 1, 2, 3, 4.
header='{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}} '  # 56 bytes
printf "\\x$(printf %02x ${#header})\\0\\0\\0\\0\\0\\0\\0%s" "$header" >"$tmp/model.safetensors"
printf '\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40\x00\x00\x80\x40' >>"$tmp/model.safetensors"
server/wtx-worker --listen 127.0.0.1:0 --port-file "$tmp/port" --log-level warn &
wpid=$!
for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
[ -s "$tmp/port" ] || fail "wtx-worker did not start"
addr="127.0.0.1:$(cat "$tmp/port")"
out=$("$tmp/trainer" "$addr" "$tmp/model.safetensors") || fail "trainer: $out"
[ "$out" = "published step-42: 1 params, 16 bytes" ] || fail "trainer said: $out"
info=$(client/wtx info "$addr" --params)
grep -q "version step-42 .* params 1  bytes 16" <<<"$info" || fail "worker holds: $info"
grep -q "^  w  16 bytes" <<<"$info" || fail "worker holds: $info"
# A worker that is not there: a clear error, exit 1.
if "$tmp/trainer" 127.0.0.1:1 "$tmp/model.safetensors" 2>"$tmp/err"; then
  fail "a push to no worker succeeded"
fi
grep -q "worker 0 (127.0.0.1:1)" "$tmp/err" || fail "unclear error: $(cat "$tmp/err")"
echo "1 passed, 0 failed"

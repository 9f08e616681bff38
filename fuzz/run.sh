#!/usr/bin/env bash
# The fuzz targets, built with clang-14's libFuzzer (+ ASan and UBSan) from
# the same sources the worker compiles (session: the whole worker), each run for WTX_FUZZ_SECONDS
# (default 20) from the committed seed corpus. A crash, a leak or a
# sanitizer report fails the test and leaves the input that caused it in
# the log, base64-encoded, to reproduce with: ./target crash-file.
set -euo pipefail
secs=${WTX_FUZZ_SECONDS:-20}
cc=${WTX_FUZZ_CC:-clang-14}
command -v "$cc" >/dev/null || { echo "FAIL: $cc is needed (scripts/setup.sh installs it)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-std=c17 -g -O1 -Wall -Wextra -Werror -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=all -I. -Iinclude -Iproto)
pb=(proto/wtx/v1/types.pb-c.c proto/wtx/v1/transport.pb-c.c proto/wtx/v1/weight_transfer.pb-c.c)

build() {  # name sources... -- libs...
  local name=$1
  shift
  local srcs=() libs=()
  while [ "$1" != "--" ]; do srcs+=("$1"); shift; done
  shift
  libs=("$@")
  "$cc" "${flags[@]}" "${srcs[@]}" -o "$tmp/$name" "${libs[@]}" 2>"$tmp/$name.build" ||
    { cat "$tmp/$name.build"; echo "FAIL: $name does not build"; exit 1; }
}

build requests fuzz/fuzz_requests.c common/text.c common/tensor.c common/error.c common/copy.c common/copy_xxh3.c \
  transport/rx.c transport/wire.c "${pb[@]}" -- -lprotobuf-c -lxxhash -lunistring
build tcp_frame fuzz/fuzz_tcp_frame.c transport/tcp_frame.c --
build safetensors fuzz/fuzz_safetensors.c common/safetensors.c common/strmap.c common/arena.c \
  common/tensor.c common/error.c -- -lyajl -lxxhash
# The real worker: every source it compiles, instrumented alike.
gen=third_party/protos
build session fuzz/fuzz_session.c server/{auth,inspect,metrics,publish,session,store,vllm,worker}.c \
  rpc/{rpc,health,reflection}.c transport/*.c common/*.c cuda/cuda.c proto/wtx/v1/*.c \
  $gen/grpc/health/v1/*.c $gen/grpc/reflection/v1/*.c $gen/grpc/reflection/v1alpha/*.c \
  $gen/google/protobuf/descriptor.pb-c.c -- -I$gen -lgrpc -lgpr -lprotobuf-c -luv -lcurl \
  -lmicrohttpd -lyajl -lxxhash -lunistring -ldl -lrt -lpthread

passed=0 failed=0
for t in requests tcp_frame safetensors session; do
  mkdir -p "$tmp/corpus-$t"
  cp fuzz/corpus/$t/* "$tmp/corpus-$t/"
  if (cd "$tmp" && "./$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$tmp/$t-" "corpus-$t" >"$tmp/$t.log" 2>&1); then
    echo "fuzz $t: $(grep -o 'Done [0-9]* runs' "$tmp/$t.log" | tail -1) in ${secs} s, no crash"
    passed=$((passed + 1))
  else
    tail -40 "$tmp/$t.log"
    for a in "$tmp/$t"-*; do [ -f "$a" ] && echo "input $a:" && base64 -w0 "$a" && echo; done
    echo "FAIL: fuzz $t"
    failed=$((failed + 1))
  fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

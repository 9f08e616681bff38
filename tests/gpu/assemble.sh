#!/usr/bin/env bash
# Assembles the GPU bundle from built binaries: each with its whole shared-
# library closure (gRPC, abseil, protobuf-c, libuv, yajl, xxhash, OpenSSL,
# libstdc++ in lib/, and glibc with its loader in lib/glibc/), run through
# wrappers that pick the loader: the machine's own when its glibc is at
# least the bundle's (the libraries it loads itself, NCCL above all, may
# need a newer glibc than the bundle's: on the lent H200, NCCL 2.28 needs
# 2.38 and failed to load against the bundle's 2.36), else the bundle's,
# so it runs on a GPU machine whatever its distribution.
# Called by tests/gpu/bundle.sh (after the Bazel build) and by the suite's
# bundle_test (from its runfiles).
# With LIBWTX (and PY, a Python with grpcio-tools), also the Python
# package for the `vllm serve` check: python/wtx with its stubs and
# libwtx.so, whose closure (glibc aside: the interpreter brings its own)
# is lib/'s, which the check puts on LD_LIBRARY_PATH.
# Usage: assemble.sh OUT WORKER CLI GPU_TEST PROBE MEMCPY GPU_MODEL DOUBLE [LIBWTX PY]
set -euo pipefail
[ $# -eq 9 ] || [ $# -eq 11 ] ||
  { echo "usage: $0 OUT WORKER CLI GPU_TEST PROBE MEMCPY SOCKET GPU_MODEL DOUBLE [LIBWTX PY]" >&2
    exit 2; }
out=$1
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/server" "$out/client" "$out/cuda/testing" \
  "$out/tests/client"
names=(wtx-worker wtx gpu_test probe memcpy_baseline socket_baseline gpu_model_worker)
srcs=("$2" "$3" "$4" "$5" "$6" "$7" "$8")
for i in "${!names[@]}"; do
  install -m 0755 "${srcs[$i]}" "$out/bin/${names[$i]}"
  strip --strip-unneeded "$out/bin/${names[$i]}" 2>/dev/null || true
done
install -m 0755 "$9" "$out/cuda/testing/libwtx_fake_cuda.so"
# The closure: every library ldd resolves, and the loader itself.
for b in "$out"/bin/* "$out/cuda/testing/libwtx_fake_cuda.so"; do
  ldd "$b" | awk '/=> \// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}'
done | sort -u | while read -r lib; do
  cp -L "$lib" "$out/lib/$(basename "$lib")"
done
[ -f "$out/lib/ld-linux-x86-64.so.2" ] || { echo "assemble: no loader found" >&2; exit 1; }
# is_glibc NAME: whether the library NAME is glibc's (or its loader).
is_glibc() {
  case $1 in
    ld-linux*|libc.so.*|libm.so.*|libmvec.so.*|libpthread.so.*|libdl.so.*|librt.so.*|\
    libresolv.so.*|libanl.so.*|libutil.so.*|libnss_*) return 0 ;;
  esac
  return 1
}
mkdir -p "$out/lib/glibc"
for lib in "$out"/lib/*; do
  [ -f "$lib" ] && is_glibc "$(basename "$lib")" && mv "$lib" "$out/lib/glibc/"
done
getconf GNU_LIBC_VERSION | awk '{print $2}' > "$out/lib/glibc/VERSION"
# wrapper DEST NAME: runs bin/NAME through the machine's loader and glibc
# when they are at least the bundle's, else the bundle's own.
wrapper() {
  local up=${3:-.}
  cat > "$1" <<WRAP
#!/bin/sh
# Runs bin/$2 with the bundle's libraries, and the machine's loader and
# glibc when they are at least as new as the bundle's (else the bundle's).
root=\$(cd "\$(dirname "\$0")/$up" && pwd)
WTX_PROBE_SELF="\$root/probe"; export WTX_PROBE_SELF
ours=\$(cat "\$root/lib/glibc/VERSION")
theirs=\$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print \$2}')
if [ -n "\$theirs" ] && [ -x /lib64/ld-linux-x86-64.so.2 ] &&
   [ "\$(printf '%s\\n%s\\n' "\$ours" "\$theirs" | sort -V | head -n 1)" = "\$ours" ]; then
  exec /lib64/ld-linux-x86-64.so.2 --library-path "\$root/lib" "\$root/bin/$2" "\$@"
fi
exec "\$root/lib/glibc/ld-linux-x86-64.so.2" --library-path "\$root/lib:\$root/lib/glibc" \\
  "\$root/bin/$2" "\$@"
WRAP
  chmod 0755 "$1"
}
wrapper "$out/server/wtx-worker" wtx-worker ..
wrapper "$out/client/wtx" wtx ..
wrapper "$out/tests/client/gpu_model_worker" gpu_model_worker ../..
for n in gpu_test probe memcpy_baseline socket_baseline; do wrapper "$out/$n" "$n"; done
install -m 0755 "$here/device_check.sh" "$out/device_check.sh"
if [ $# -eq 11 ]; then
  root=$(cd "$here/../.." && pwd)
  mkdir -p "$out/python"
  cp -rL "$root/python/src/wtx" "$out/python/"
  rm -rf "$out/python/wtx/v1" "$out/python/wtx/_lib"
  mkdir -p "$out/python/wtx/_lib"
  install -m 0755 "${10}" "$out/python/wtx/_lib/libwtx.so"
  "${11}" -c "import sys, pathlib; sys.path.insert(0, '$root/python/build_backend'); \
import wtx_build; wtx_build.generate_stubs(pathlib.Path('$root/proto'), pathlib.Path('$out/python'))"
  ldd "${10}" | awk '/=> \// {print $3}' | while read -r lib; do
    n=$(basename "$lib")
    is_glibc "$n" || [ -f "$out/lib/$n" ] || cp -L "$lib" "$out/lib/"
  done
fi
{
  echo "wtx GPU bundle, assembled $(date -u +%FT%TZ) on $(uname -srm)"
  (cd "$here" && git rev-parse HEAD 2>/dev/null) || true
} > "$out/MANIFEST"
echo "bundle: $out ($(du -sh "$out" | cut -f1))"

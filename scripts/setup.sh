#!/usr/bin/env bash
# Installs what wtx needs on Debian 12, by need. Idempotent: a package or
# Python environment already installed is not touched, so a second run
# takes a second.
# Usage: scripts/setup.sh [--build | --all]   (default --all; --help)
set -euo pipefail

usage() {
  cat <<'TXT'
Usage: scripts/setup.sh [--build | --all]

  --build  what the main job needs (scripts/run.sh): Bazel, the compilers and
           the C libraries wtx links. About 0.9 GB of Debian packages with
           their dependencies (Bazel's Java runtime is most of it).
  --all    that, and what the tests need (scripts/test.sh, the default):
           GoogleTest, clang-14 (libFuzzer), buildah, kubectl, Python 3
           (about 0.7 GB more of packages); then two Python environments
           from PyPI, made once per machine in $WTX_CACHE (~/.cache/wtx):
           .venv (torch, transformers: about 6 GB) and .venv-vllm (vLLM 0.33
           with its torch: about 9 GB).
TXT
}

part=all
case "${1:-}" in
  --build) part=build ;;
  --all | "") part=all ;;
  -h | --help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac

# What the main job builds: wtx-worker and the wtx CLI.
PACKAGES=(
  bazel-bootstrap          # Bazel 4.2.3, run offline (WORKSPACE)
  gcc g++                  # C17 + C++17 (GoogleTest)
  libgrpc-dev              # gRPC core C API
  libprotobuf-c-dev protobuf-c-compiler   # messages (protobuf-c 1.4)
  protobuf-compiler libprotoc-dev         # protoc 3.21, plugin.proto
  grpc-proto               # health + reflection .proto files
  libuv1-dev               # event loop
  libxxhash-dev            # XXH3 checksums
  libyajl-dev              # JSON (safetensors headers)
  libcurl4-openssl-dev     # HTTP to vLLM (server/vllm.c, the sidecar bridge)
  libmicrohttpd-dev        # GET /metrics (Prometheus, server/worker.c)
  uthash-dev               # hash tables (common/strmap.c)
  libunistring-dev         # UTF-8 validation of names and versions
)
# What only the tests need.
[ "$part" = all ] && PACKAGES+=(
  libgtest-dev             # GoogleTest
  buildah                  # the container image (deploy/image, tests/deploy)
  clang-14 libclang-rt-14-dev   # libFuzzer targets (fuzz/)
  python3 python3-venv     # Python client tests
  openssl                  # test certificates (TLS client test)
)

# kubectl (deploy/ is rendered with `kubectl kustomize`): Debian's, unless
# the machine has one already (a cloud SDK's owns /usr/bin/kubectl).
[ "$part" = build ] || command -v kubectl >/dev/null || PACKAGES+=(kubernetes-client)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ "$part" = all ] || exit 0

# The Python environments of the tests, from PyPI, installed once per
# machine: each lives in $WTX_CACHE (default ~/.cache/wtx) under a name
# that includes the hash of its requirements file, and the checkout links
# to it (.venv, .venv-vllm). A clean clone on the same machine reuses them;
# a changed requirements file makes a new one.
cd "$(dirname "$0")/.."
cache=${WTX_CACHE:-$HOME/.cache/wtx}
venv() { # REQUIREMENTS LINK
  local req=$1 link=$2 hash dir
  hash=$(sha256sum "$req" | cut -c1-16)
  dir="$cache/$(basename "$link")-$hash"
  if [ ! -f "$dir/.complete" ]; then
    echo "setup: preparing $dir ($req)" >&2
    rm -rf "$dir"
    mkdir -p "$cache"
    python3 -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check -r "$req"
    touch "$dir/.complete"
  fi
  [ -L "$link" ] || rm -rf "$link"
  ln -sfn "$dir" "$link"
}
# The cross-language and Python-package tests (torch, transformers: ~6 GB).
venv tests/python/requirements.txt .venv
# The vLLM integration tests (vllm 0.33 with its torch: ~9 GB).
venv tests/python/vllm-requirements.txt .venv-vllm

#!/usr/bin/env bash
# Installs what wtx needs to build and test on Debian 12. Idempotent: a package
# already installed is not touched, so a second run takes a second.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap          # Bazel 4.2.3, run offline (WORKSPACE)
  gcc g++                  # C17 + C++17 (GoogleTest)
  libgrpc-dev              # gRPC core C API
  libprotobuf-c-dev protobuf-c-compiler   # messages (protobuf-c 1.4)
  protobuf-compiler libprotoc-dev         # protoc 3.21, plugin.proto
  grpc-proto               # health + reflection .proto files
  libuv1-dev               # event loop
  libgtest-dev             # GoogleTest
  libxxhash-dev            # XXH3 checksums
  libyajl-dev              # JSON (safetensors headers)
  libcurl4-openssl-dev     # HTTP to vLLM (server/vllm.c, the sidecar bridge)
  uthash-dev               # hash tables (common/strmap.c)
  libunistring-dev         # UTF-8 validation of names and versions
  clang-14 libclang-rt-14-dev   # libFuzzer targets (fuzz/)
  python3 python3-venv     # Python client tests
  openssl                  # test certificates (TLS client test)
)

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

# Python environment of the cross-language tests (tests/python), from PyPI.
# Reinstalled only when requirements.txt changes.
req=tests/python/requirements.txt
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! cmp -s "$req" .venv/requirements.txt; then
  echo "setup: preparing .venv ($req)" >&2
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r "$req"
  cp "$req" .venv/requirements.txt
fi

# The vLLM integration tests' venv (vllm 0.33 from PyPI, about 9 GB with
# torch): installed once per machine, reinstalled only when
# vllm-requirements.txt changes.
req=tests/python/vllm-requirements.txt
if [ ! -x .venv-vllm/bin/python ] || ! cmp -s "$req" .venv-vllm/requirements.txt; then
  echo "setup: preparing .venv-vllm ($req)" >&2
  python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --disable-pip-version-check -r "$req"
  cp "$req" .venv-vllm/requirements.txt
fi

#!/usr/bin/env bash
# The container image's root filesystem (deploy/image/build-rootfs.sh), as
# it ships: wtx-worker run from it (chroot, as the non-root user 10001),
# its gRPC health checked with grpcurl, a model pushed into it with the
# token (and refused without), then the Dockerfile (FROM scratch, copying
# that root filesystem) built with buildah. Running the image with podman
# or buildah is not possible on the CI machines (a container without
# permission to set RLIMIT_NOFILE, cgroups in hybrid mode): chroot runs the
# same files.
set -euo pipefail
tmp=${TEST_TMPDIR:-$(mktemp -d)}
rootfs=$tmp/image/rootfs
mkdir -p "$tmp/image"
deploy/image/build-rootfs.sh "$rootfs" server/wtx-worker client/wtx
grpcurl=${WTX_PYTHON%/python}/grpcurl
[ -x "$grpcurl" ] || { echo "FAIL: grpcurl (WTX_PYTHON's venv) is needed"; exit 1; }
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
echo "$token" > "$rootfs/var/run/wtx/token"
chmod 0444 "$rootfs/var/run/wtx/token"
chroot=$(command -v chroot || echo /usr/sbin/chroot)
if [ "$(id -u)" = 0 ]; then run=("$chroot" --userspec=10001:10001 "$rootfs")
else run=(unshare --user --map-root-user "$chroot" "$rootfs"); fi
"${run[@]}" /usr/bin/wtx-worker --listen 127.0.0.1:0 --port-file /tmp/port \
  --token-file /var/run/wtx/token --log-level warn &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do [ -s "$rootfs/tmp/port" ] && break; sleep 0.05; done
addr="127.0.0.1:$(cat "$rootfs/tmp/port")"
"$grpcurl" -plaintext "$addr" grpc.health.v1.Health/Check | tee "$tmp/health"
grep -q SERVING "$tmp/health"
if client/wtx push --workers "$addr" --backend tcp synthetic:16M 2>"$tmp/refused"; then
  echo "FAIL: a push without the token went through"; exit 1
fi
grep -q UNAUTHENTICATED "$tmp/refused"
client/wtx push --workers "$addr" --backend tcp --token "$token" --version from-image \
  --verify synthetic:16M
client/wtx info "$addr" --token "$token" | tee "$tmp/info"
grep -q "from-image" "$tmp/info"
# The image itself: FROM scratch, this root filesystem.
if command -v buildah >/dev/null; then
  cp deploy/image/Dockerfile "$tmp/image/"
  buildah --storage-driver vfs --root "$tmp/containers" --runroot "$tmp/run" \
    bud -q -t wtx-test "$tmp/image" >/dev/null
  buildah --storage-driver vfs --root "$tmp/containers" --runroot "$tmp/run" \
    inspect --format '{{.OCIv1.Config.User}} {{.OCIv1.Config.Entrypoint}}' wtx-test |
    tee "$tmp/inspect"
  grep -q "10001:10001 \[/usr/bin/wtx-worker\]" "$tmp/inspect"
else
  echo "FAIL: buildah is needed (scripts/setup.sh)"; exit 1
fi
echo "image: ok"

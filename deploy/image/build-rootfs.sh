#!/usr/bin/env bash
# The container image's whole root filesystem, from built binaries:
# wtx-worker and wtx in /usr/bin, every library they load (glibc and its
# loader included) at the path the loader looks for it, CA certificates,
# a non-root user (wtx, 10001), and empty /tmp, /dev/shm, /weights mount
# points. The Dockerfile beside it is FROM scratch and copies exactly this,
# so what the suite runs (tests/deploy:image_test, chroot) is what ships.
# Usage: build-rootfs.sh OUT WORKER CLI
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 OUT WORKER CLI" >&2; exit 2; }
out=$1
rm -rf "$out"
mkdir -p "$out/usr/bin" "$out/etc/ssl/certs" "$out/tmp" "$out/dev/shm" "$out/weights" \
  "$out/var/run/wtx"
install -m 0755 "$2" "$out/usr/bin/wtx-worker"
install -m 0755 "$3" "$out/usr/bin/wtx"
strip --strip-unneeded "$out/usr/bin/wtx-worker" "$out/usr/bin/wtx" 2>/dev/null || true
for b in "$out/usr/bin/wtx-worker" "$out/usr/bin/wtx"; do
  ldd "$b" | awk '/=> \// {print $3} $1 ~ /^\// {print $1}'
done | sort -u | while read -r lib; do
  mkdir -p "$out$(dirname "$lib")"
  cp -L "$lib" "$out$lib"
done
# Name resolution for a static /etc (no NSS services beyond files and dns).
for lib in /lib/x86_64-linux-gnu/libnss_dns.so.2 /lib/x86_64-linux-gnu/libnss_files.so.2 \
           /lib/x86_64-linux-gnu/libresolv.so.2; do
  [ -e "$lib" ] && { mkdir -p "$out$(dirname "$lib")"; cp -L "$lib" "$out$lib"; }
done
cp -L /etc/ssl/certs/ca-certificates.crt "$out/etc/ssl/certs/"
printf 'root:x:0:0:root:/root:/sbin/nologin\nwtx:x:10001:10001:wtx:/tmp:/sbin/nologin\n' \
  > "$out/etc/passwd"
printf 'root:x:0:\nwtx:x:10001:\n' > "$out/etc/group"
printf 'hosts: files dns\n' > "$out/etc/nsswitch.conf"
chmod 1777 "$out/tmp" "$out/dev/shm"
chown 10001:10001 "$out/weights" 2>/dev/null || true
echo "rootfs: $out ($(du -sh "$out" | cut -f1))"

#!/usr/bin/env bash
# Builds the kvpool container image from this checkout's binaries with Debian's buildah, from
# scratch: kvpoold and the kvpool CLI, the shared libraries they load (read from ldd), a
# non-root user, kvpoold as the entrypoint listening on every interface.
#
#   deploy/image/build.sh [BIN_DIR] [TAG]
#
# BIN_DIR (default target/release) holds kvpoold and kvpool, built beforehand (`cargo build
# --release -p kvpool-server -p kvpool-cli`); TAG defaults to kvpool:<version>. Nothing is
# pulled from a registry: the image's only layer is what this script copies in. Needs root (or
# `buildah unshare`). Prints the tag.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin_dir="${1:-target/release}"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
tag="${2:-kvpool:$version}"
for b in kvpoold kvpool; do
  [ -x "$bin_dir/$b" ] || { echo "build.sh: $bin_dir/$b is missing: build it first" >&2; exit 1; }
done
command -v buildah >/dev/null || { echo "build.sh: buildah is not installed (apt-get install buildah)" >&2; exit 1; }

ctr=$(buildah from --name "kvpool-build-$$" scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
root=$(buildah mount "$ctr")

install -d -m 0755 "$root/usr/local/bin" "$root/etc"
install -m 0755 "$bin_dir/kvpoold" "$bin_dir/kvpool" "$root/usr/local/bin/"
# Every library the binaries load, the dynamic loader among them, at the path ldd resolves it
# to, so the loader finds each where the binary's own search finds it on the build machine.
libs=$(for b in kvpoold kvpool; do
  ldd "$bin_dir/$b" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
done | sort -u)
for lib in $libs; do
  cp -L --parents "$lib" "$root/"
done
# The user the daemon runs as (uid and gid 10001), the name service's order, a /tmp.
printf 'root:x:0:0:root:/:/usr/sbin/nologin\nkvpool:x:10001:10001:kvpool:/nonexistent:/usr/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nkvpool:x:10001:\n' >"$root/etc/group"
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
install -d -m 1777 "$root/tmp"
buildah umount "$ctr" >/dev/null

buildah config \
  --entrypoint '["/usr/local/bin/kvpoold"]' --cmd '' \
  --user 10001:10001 --workingdir / \
  --env KVPOOL_TCP=0.0.0.0:7370 --env KVPOOL_QUIC=0.0.0.0:7371 --env KVPOOL_METRICS=0.0.0.0:7372 \
  --port 7370/tcp --port 7371/udp --port 7372/tcp \
  --stop-signal SIGTERM \
  --label org.opencontainers.image.title=kvpool \
  --label "org.opencontainers.image.description=kvpoold, the kvpool cache daemon, and the kvpool CLI" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
  --label org.opencontainers.image.licenses="$(sed -n 's/^license = "\(.*\)"/\1/p' Cargo.toml | head -n1)" \
  "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
trap - EXIT
echo "$tag"

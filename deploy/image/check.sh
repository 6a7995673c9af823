#!/usr/bin/env bash
# Inspects and smoke-tests the image that build.sh made (CI runs it on every change):
# - its configuration: one layer, entrypoint kvpoold, user 10001, the three ports, the labels;
# - the binaries run inside its root, as that user (chroot): kvpoold --version and
#   --print-config, kvpool --help;
# - a container of it (podman, with runc): it starts and becomes ready (/ready answers 200),
#   serves a put and a get from the kvpool CLI outside it, and on SIGTERM (podman stop) exits
#   0 having logged its stop.
#
#   deploy/image/check.sh TAG [BIN_DIR]
#
# BIN_DIR (default target/release) holds the kvpool CLI the smoke test drives from outside.
# Needs root.
#
# Containers run with runc: crun (podman's default on Debian 12) refuses a machine whose
# cgroups are in hybrid mode (v1 controllers beside a v2 hierarchy, as on this project's build
# machines): "crun: cgroups in hybrid mode not supported, drop all controllers from cgroupv2".
# The container's open-file and process limits are set at or below this shell's, since raising
# them past it is refused where the runtime runs without CAP_SYS_RESOURCE ("setrlimit
# `RLIMIT_NOFILE`: Operation not permitted").
set -euo pipefail
cd "$(dirname "$0")/../.."
tag="${1:?usage: deploy/image/check.sh TAG [BIN_DIR]}"
bin_dir="${2:-target/release}"
fail() { echo "check.sh: $*" >&2; exit 1; }

echo "== the image's configuration"
buildah inspect --type image "$tag" >"${TMPDIR:-/tmp}/kvpool-image-$$.json"
python3 - "${TMPDIR:-/tmp}/kvpool-image-$$.json" <<'PY'
import json
import sys

image = json.load(open(sys.argv[1]))
config = image["OCIv1"]["config"]
layers = image["OCIv1"]["rootfs"]["diff_ids"]
want = {
    "layers": 1,
    "Entrypoint": ["/usr/local/bin/kvpoold"],
    "User": "10001:10001",
    "ExposedPorts": ["7370/tcp", "7371/udp", "7372/tcp"],
}
got = {
    "layers": len(layers),
    "Entrypoint": config.get("Entrypoint"),
    "User": config.get("User"),
    "ExposedPorts": sorted(config.get("ExposedPorts", {})),
}
labels = config.get("Labels", {})
for label in ("title", "description", "version", "revision", "licenses"):
    if not labels.get(f"org.opencontainers.image.{label}"):
        got.setdefault("missing labels", []).append(label)
if got != want:
    sys.exit(f"the image's configuration: {got}, expected {want}")
print(f"one layer, entrypoint {got['Entrypoint']}, user {got['User']}, ports {got['ExposedPorts']}")
PY
rm -f "${TMPDIR:-/tmp}/kvpool-image-$$.json"

echo "== the binaries in its root, as its user"
ctr=$(buildah from --name "kvpool-check-$$" "$tag")
root=$(buildah mount "$ctr")
as_user() { chroot --userspec=10001:10001 "$root" "$@"; }
as_user /usr/local/bin/kvpoold --version
as_user /usr/local/bin/kvpoold --print-config >/dev/null
as_user /usr/local/bin/kvpool --help >/dev/null
buildah umount "$ctr" >/dev/null
buildah rm "$ctr" >/dev/null

echo "== a container: start, ready, put and get, SIGTERM"
podman=(podman --runtime runc)
name="kvpool-smoke-$$"
port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
tcp=$(port)
metrics=$(port)
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
cleanup() { "${podman[@]}" rm -f -t 0 "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
"${podman[@]}" run -d --name "$name" \
  --ulimit "nofile=$(ulimit -n):$(ulimit -n)" --ulimit "nproc=1024:1024" --shm-size 128m \
  -p "127.0.0.1:$tcp:7370" -p "127.0.0.1:$metrics:7372" \
  -e KVPOOL_TOKEN="$token" -e KVPOOL_ADVERTISE="127.0.0.1:$tcp" \
  "$tag" --memory 64MiB >/dev/null
ready=""
for _ in $(seq 1 100); do
  ready=$(python3 - "$metrics" <<'PY' || true
import sys
import urllib.request

try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=2) as r:
        print(r.status, r.read().decode().strip())
except Exception as e:  # not up yet
    print(getattr(e, "code", "down"))
PY
  )
  [ "$ready" = "200 serving" ] && break
  sleep 0.1
done
[ "$ready" = "200 serving" ] || { "${podman[@]}" logs "$name" >&2; fail "never ready: $ready"; }
echo "ready: $ready"
cli=("$bin_dir/kvpool" -e "tcp://127.0.0.1:$tcp" --token "$token" --no-local)
head -c 100000 /dev/urandom >"${TMPDIR:-/tmp}/kvpool-value-$$"
"${cli[@]}" put smoke-key "${TMPDIR:-/tmp}/kvpool-value-$$"
"${cli[@]}" get smoke-key --output "${TMPDIR:-/tmp}/kvpool-got-$$"
cmp "${TMPDIR:-/tmp}/kvpool-value-$$" "${TMPDIR:-/tmp}/kvpool-got-$$" || fail "get returned other bytes"
rm -f "${TMPDIR:-/tmp}/kvpool-value-$$" "${TMPDIR:-/tmp}/kvpool-got-$$"
echo "put and get: 100000 bytes back intact"
if "${cli[@]}" --token wrong get smoke-key >/dev/null 2>&1; then
  fail "a wrong token was served"
fi
"${podman[@]}" stop -t 30 "$name" >/dev/null
code=$("${podman[@]}" inspect "$name" --format '{{.State.ExitCode}}')
[ "$code" = 0 ] || { "${podman[@]}" logs "$name" >&2; fail "exit code $code after SIGTERM"; }
log=$("${podman[@]}" logs "$name" 2>&1)
case "$log" in *"kvpoold stopped"*) ;; *) fail "no 'kvpoold stopped' in its log: $log" ;; esac
echo "stopped on SIGTERM: exit 0"

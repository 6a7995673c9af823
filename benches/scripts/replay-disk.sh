#!/usr/bin/env bash
# The hit rate per tier on a real daemon: one kvpoold with DRAM for CAPACITY blocks replays the
# bundled trace alone, then a fresh one with a disk tier of RATIO times those blocks under it
# (every eviction admitted); the disk's share of the hits comes from the daemon's own counters.
# The simulation of the same setting (`kvpool-bench replay --disk-ratio`) runs beside them.
#
#   cargo build --release -p kvpool-bench -p kvpool-server
#   benches/scripts/replay-disk.sh [CAPACITY=1000] [POLICY=s3fifo-lru] [BLOCK=16KiB] [RATIO=10] [LIMIT=3000]
#
# The daemon has no namespace quota (a namespace with one gets only its share of the disk, and
# demotions past that share are refused rather than making room): its --memory is CAPACITY
# blocks, so its DRAM holds about that many. Each block takes a whole disk record (a 56-byte
# header and its key before the value, padded to 4 KiB), and the tier's capacity is RATIO *
# CAPACITY such records. DISK_DIR (default /var/tmp) must be on a real disk; DISK_QUEUE (default
# 256MiB, the daemon's) bounds the demotion queue. Everything it
# starts is stopped on exit, and each replay is bounded by `timeout`.
set -euo pipefail
CAPACITY=${1:-1000}
POLICY=${2:-s3fifo-lru}
BLOCK=${3:-16KiB}
RATIO=${4:-10}
LIMIT=${5:-3000}
DISK_DIR=${DISK_DIR:-/var/tmp}
DISK_QUEUE=${DISK_QUEUE:-256MiB}
bin=${KVPOOL_BIN:-target/release}
case $BLOCK in
  *KiB) bytes=$(( ${BLOCK%KiB} * 1024 ));;
  *MiB) bytes=$(( ${BLOCK%MiB} * 1024 * 1024 ));;
  *) bytes=$BLOCK;;
esac
case $(stat -f -c %T "$DISK_DIR") in
  tmpfs|ramfs) echo "DISK_DIR=$DISK_DIR is in memory: pick a directory on a disk" >&2; exit 1;;
esac
# The replay's keys: a 4-byte run tag and a 9-byte block key.
record=$(( (56 + 13 + bytes + 4095) / 4096 * 4096 ))
region=$(( 16 << 20 ))
disk=$(( (RATIO * CAPACITY * record + region - 1) / region * region ))
memory=$(( (CAPACITY * bytes + 1048575) / 1048576 ))MiB
work=$(mktemp -d /dev/shm/kvpool-replay-disk-XXXXXX)
tier=$(mktemp -d "$DISK_DIR/kvpool-replay-disk-XXXXXX")
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work" "$tier"; }
trap cleanup EXIT
cat > "$work/ns.toml" <<TOML
[[namespace]]
name = "default"
eviction = "$POLICY"
TOML

# start NAME [flags...]: starts a node; sets tcp= and metrics=
start() {
  local name=$1; shift
  mkdir -p "$work/$name"
  "$bin/kvpoold" --config "$work/ns.toml" --data-dir "$work/$name" --memory "$memory" \
    --tcp 127.0.0.1:0 --quic "" --metrics 127.0.0.1:0 "$@" \
    > "$work/$name.out" 2> "$work/$name.err" &
  pid=$!
  for _ in $(seq 100); do
    if grep -q "kvpoold ready" "$work/$name.out" 2>/dev/null; then
      tcp=$(sed -n 's/.*tcp=\([^ ]*\).*/\1/p' "$work/$name.out")
      metrics=$(sed -n 's/.*metrics=\([^ ]*\).*/\1/p' "$work/$name.out")
      return; fi
    sleep 0.1
  done
  echo "node $name did not start" >&2; cat "$work/$name.err" >&2; exit 1
}
stop() { kill "$pid"; wait "$pid" || true; pid=; }
# metric NAME: the node's counter NAME (0 when absent)
metric() {
  curl -s "http://$metrics/metrics" | awk -v n="$1" '$1 ~ "^"n"[{ ]" || $1 == n {v=$2} END {print v+0}'
}

common=(replay --engine pool --policy "$POLICY" --capacity "$CAPACITY" --block-bytes "$BLOCK"
        --limit "$LIMIT" --no-plot)
echo "== simulation: $POLICY, $CAPACITY blocks of $BLOCK, alone and over $RATIO x on disk =="
"$bin/kvpool-bench" replay --policy "$POLICY,unbounded" --capacity "$CAPACITY" \
  --disk-ratio "$RATIO" --disk-admit all --limit "$LIMIT" --no-plot --out "$work/sim" \
  | grep -E "^(sim|disk tier)"

echo "== real daemon, DRAM only ($memory) =="
start dram
timeout 1800 "$bin/kvpool-bench" "${common[@]}" --endpoint "tcp://$tcp" --out "$work/dram" \
  | grep -E "^pool"
echo "evictions $(metric kvpool_evictions_total)"
stop

echo "== real daemon, DRAM ($memory) over $(( disk >> 20 ))MiB of disk in $tier =="
start disk --disk-path "$tier" --disk-capacity "$(( disk >> 20 ))MiB" \
  --disk-region-size "$(( region >> 20 ))MiB" --disk-admit all --disk-queue "$DISK_QUEUE"
timeout 1800 "$bin/kvpool-bench" "${common[@]}" --endpoint "tcp://$tcp" --out "$work/disk" \
  | grep -E "^pool"
# What the replay left waiting for the disk: blocks in the queue are in neither tier for
# lookups, so a replay that outruns the disk finds fewer blocks on disk than the simulation,
# whose demotions are instant.
echo "disk_queued_bytes_at_the_end $(metric kvpool_disk_queued_bytes)"
t0=$(date +%s.%N)
while [ "$(metric kvpool_disk_queued_bytes)" != 0 ]; do sleep 0.1; done
echo "queue drained $(echo "$(date +%s.%N) - $t0" | bc) s after the replay"
for m in evictions_total disk_demotions_total disk_already_on_disk_total disk_withdrawn_total \
         disk_not_admitted_total disk_share_refused_total disk_queue_drops_total \
         disk_write_failures_total disk_promotions_total disk_promotion_failures_total \
         disk_hits_total disk_misses_total disk_regions_dropped_total disk_evictions_total \
         disk_objects disk_checksum_failures_total disk_io_errors_total; do
  echo "$m $(metric "kvpool_$m")"
done
stop

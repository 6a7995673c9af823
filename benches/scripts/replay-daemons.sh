#!/usr/bin/env bash
# Pooled against private caches on real daemons: N kvpoold joined into one cluster (the client
# routes every block to its owner) against N standalone kvpoold (requests spread round-robin),
# every node with a namespace quota of CAPACITY blocks. Replays the bundled trace through each.
#
#   cargo build --release -p kvpool-bench -p kvpool-server
#   benches/scripts/replay-daemons.sh [NODES=4] [CAPACITY=1250] [POLICY=lru] [BLOCK=16KiB] [LIMIT=]
#
# LIMIT replays only the first LIMIT requests (quick runs). Everything it starts is stopped on
# exit, and each replay is bounded by `timeout`.
set -euo pipefail
NODES=${1:-4}
CAPACITY=${2:-1250}
POLICY=${3:-lru}
BLOCK=${4:-16KiB}
LIMIT=${5:-}
bin=${KVPOOL_BIN:-target/release}
case $BLOCK in
  *KiB) bytes=$(( ${BLOCK%KiB} * 1024 ));;
  *MiB) bytes=$(( ${BLOCK%MiB} * 1024 * 1024 ));;
  *) bytes=$BLOCK;;
esac
quota=$(( CAPACITY * bytes ))
memory=$(( (quota + quota / 8) / 1048576 + 64 ))MiB
work=$(mktemp -d /dev/shm/kvpool-replay-XXXXXX)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
cat > "$work/ns.toml" <<TOML
[[namespace]]
name = "default"
quota = $quota
eviction = "$POLICY"
TOML

# start NAME ID [flags...]: starts a node, prints its TCP address
start() {
  local name=$1 id=$2; shift 2
  mkdir -p "$work/$name"
  "$bin/kvpoold" --config "$work/ns.toml" --node-id "$id" --data-dir "$work/$name" \
    --memory "$memory" --tcp 127.0.0.1:0 --quic "" --metrics "" --heartbeat-ms 100 "$@" \
    > "$work/$name.out" 2> "$work/$name.err" &
  pids+=($!)
  for _ in $(seq 100); do
    if grep -q "kvpoold ready" "$work/$name.out" 2>/dev/null; then
      sed -n 's/.*tcp=\([^ ]*\).*/\1/p' "$work/$name.out"; return; fi
    sleep 0.1
  done
  echo "node $name did not start" >&2; cat "$work/$name.err" >&2; exit 1
}

limit=()
[ -n "$LIMIT" ] && limit=(--limit "$LIMIT")
common=(replay --engine pool --policy "$POLICY" --capacity "$CAPACITY" --block-bytes "$BLOCK"
        --no-plot "${limit[@]}")

seed=$(start c0 0)
for i in $(seq 1 $((NODES - 1))); do
  start "c$i" "$i" --peer "$seed" --cluster-secret-file "$work/c0/cluster.secret" > /dev/null
done
for _ in $(seq 100); do
  n=$("$bin/kvpool" -e "tcp://$seed" cluster status --json | grep -o '"state":"serving"' | wc -l)
  [ "$n" -eq "$NODES" ] && break; sleep 0.1
done
echo "== pooled: $NODES clustered daemons, one endpoint, the client routes =="
timeout 1800 "$bin/kvpool-bench" "${common[@]}" --nodes "$NODES" --scenario pooled \
  --endpoint "tcp://$seed" --out "$work/pooled"

eps=()
for i in $(seq 0 $((NODES - 1))); do eps+=(--endpoint "tcp://$(start "s$i" "$((100 + i))")"); done
echo "== private: $NODES standalone daemons, requests round-robin =="
timeout 1800 "$bin/kvpool-bench" "${common[@]}" --nodes "$NODES" --scenario private \
  "${eps[@]}" --out "$work/private"

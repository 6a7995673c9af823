#!/usr/bin/env bash
# The hit rate in the minutes around a node draining or joining, on real daemons
# replaying the bundled trace in real time, against control runs in which the cluster stays as
# it was. Each run gets its own cluster of kvpoold on loopback, every node with a namespace quota
# of CAPACITY blocks:
#
#   drain            NODES nodes; at AT s node NODES-1 drains (handover on, the default)
#   drain-nohandover the same with --handover false: the drained node's blocks are lost
#   ctl-drain        NODES nodes, no event
#   join             NODES-1 nodes; at AT s node NODES-1 starts and joins
#   join-nohandover  the same with --handover false: the client's previous-owner fallback only
#   ctl-join         NODES-1 nodes, no event
#   rolling          NODES nodes; from AT s every node in turn, ROLLING_GAP s apart (default
#                    30), is stopped with SIGTERM (it drains) and started again with the same
#                    flags on the same directory and address (the upgrade path); its control
#                    is ctl-drain. Not in the default set: RUNS="rolling ctl-drain", with
#                    --after long enough for every restart (ELASTIC_ARGS="--after 240");
#                    ROLLING_FRESH=1 removes each node's journal before its start, so it
#                    starts empty instead of recovering; ROLLING_MODE=restart starts every
#                    node with --restart-on-shutdown, so each restarts in place (it keeps its
#                    keys while it is away) instead of draining (ROLLING_MODE=drain, default)
#
#   cargo build --release -p kvpool-bench -p kvpool-server -p kvpool-cli
#   benches/scripts/elastic-replay.sh [NODES=4] [CAPACITY=5000] [BLOCK=16KiB] [AT=1200] [RUNS=all]
#
# KEEP_WORK=1 keeps the work directory (the nodes' data and logs) instead of removing it.
# ELASTIC_ARGS passes more flags to `kvpool-bench elastic` (e.g. "--before 30 --after 60 --speed 4"
# for a quick look). RUNS is a space-separated subset of the names above; PARALLEL=1 runs them at once (the paced
# part is light; the warm-ups then share the cores). Every replay is bounded by `timeout`, and
# everything started is stopped on exit. The windows go to stdout and to $OUT/elastic.csv
# (OUT defaults to bench-out/elastic).
set -euo pipefail
NODES=${1:-4}
CAPACITY=${2:-5000}
BLOCK=${3:-16KiB}
AT=${4:-1200}
RUNS=${5:-${RUNS:-drain drain-nohandover ctl-drain join join-nohandover ctl-join}}
OUT=${OUT:-bench-out/elastic}
bin=$(realpath "${KVPOOL_BIN:-target/release}")
case $BLOCK in
  *KiB) bytes=$(( ${BLOCK%KiB} * 1024 ));;
  *MiB) bytes=$(( ${BLOCK%MiB} * 1024 * 1024 ));;
  *) bytes=$BLOCK;;
esac
quota=$(( CAPACITY * bytes ))
memory=$(( (quota + quota / 8) / 1048576 + 64 ))MiB
work=$(mktemp -d /dev/shm/kvpool-elastic-XXXXXX)
mkdir -p "$OUT"
rm -f "$OUT/elastic.csv"
cleanup() {
  # Every daemon any run started, including the ones an event started.
  cat "$work"/*/pids 2>/dev/null | xargs -r kill 2>/dev/null || true
  wait 2>/dev/null || true
  if [ "${KEEP_WORK:-0}" = 1 ]; then echo "kept $work (the nodes' logs: */n*.err)" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
cat > "$work/ns.toml" <<TOML
[[namespace]]
name = "default"
quota = $quota
eviction = "lru"
TOML

# A script that starts node ID of the cluster in DIR (seed SEED, handover HANDOVER) and, with
# `wait`, returns once the seed's view shows it serving. Used directly and as a join event.
cat > "$work/start-node.sh" <<'SH'
#!/usr/bin/env bash
set -euo pipefail
dir=$1 id=$2 handover=$3 seed=${4:-} wait=${5:-} tcp=${6:-127.0.0.1:0}
mkdir -p "$dir/n$id"
peer=()
RESTART_FLAGS=()
[ "${ROLLING_MODE:-drain}" = restart ] && RESTART_FLAGS=(--restart-on-shutdown true)
[ -n "$seed" ] && peer=(--peer "$seed" --cluster-secret-file "$dir/n0/cluster.secret")
"$BIN/kvpoold" --config "$WORK/ns.toml" --node-id "$id" --data-dir "$dir/n$id" \
  --memory "$MEMORY" --tcp "$tcp" --quic "" --metrics "" --heartbeat-ms 100 \
  --handover "$handover" "${peer[@]}" "${RESTART_FLAGS[@]}" > "$dir/n$id.out" 2> "$dir/n$id.err" &
echo $! >> "$dir/pids"
echo $! > "$dir/n$id.pid"
for _ in $(seq 200); do
  if grep -q "kvpoold ready" "$dir/n$id.out" 2>/dev/null; then break; fi
  sleep 0.1
done
grep -q "kvpoold ready" "$dir/n$id.out" || { echo "node $id did not start" >&2; cat "$dir/n$id.err" >&2; exit 1; }
addr=$(sed -n 's/.*tcp=\([^ ]*\).*/\1/p' "$dir/n$id.out")
echo "$addr" > "$dir/n$id.addr"
if [ -n "$wait" ]; then
  for _ in $(seq 300); do
    "$BIN/kvpool" -e "tcp://${seed:-$addr}" cluster status --json | grep -q "\"id\":$id,[^}]*\"state\":\"serving\"" && exit 0
    sleep 0.1
  done
  echo "node $id did not become serving" >&2; exit 1
fi
SH
chmod +x "$work/start-node.sh"

# A rolling restart of the NODES nodes in DIR (the `rolling` run's event): each in turn gets
# SIGTERM (it drains, hands its blocks to the nodes that own them while it is away, and exits),
# then is started again with its first life's flags on its directory and address; the next
# follows GAP s after the whole cluster serves again.
cat > "$work/rolling-restart.sh" <<'SH'
#!/usr/bin/env bash
set -euo pipefail
dir=$1 nodes=$2 handover=$3 gap=$4
seed=$(cat "$dir/n0.addr")
alive() { [ -e "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
for id in $(seq 0 $((nodes - 1))); do
  pid=$(cat "$dir/n$id.pid")
  t0=$(date +%s.%N)
  kill -TERM "$pid"
  for _ in $(seq 1200); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then echo "node $id did not exit within 120 s of SIGTERM" >&2; exit 1; fi
  t1=$(date +%s.%N)
  s=$seed; [ "$id" = 0 ] && s=""
  # ROLLING_FRESH=1: the node starts empty (its journal removed) instead of recovering.
  if [ "${ROLLING_FRESH:-0}" = 1 ]; then rm -f "$dir/n$id"/journal-*.kvj; fi
  "$WORK/start-node.sh" "$dir" "$id" "$handover" "$s" "" "$(cat "$dir/n$id.addr")"
  other=$(cat "$dir/n$(( (id + 1) % nodes )).addr")
  for _ in $(seq 300); do
    n=$("$BIN/kvpool" -e "tcp://$other" cluster status --json | grep -o '"state":"serving"' | wc -l)
    [ "$n" -eq "$nodes" ] && break; sleep 0.1
  done
  [ "$n" -eq "$nodes" ] || { echo "node $id did not serve again" >&2; exit 1; }
  t2=$(date +%s.%N)
  echo "rolling restart: node $id stopped in $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") s, serving again $(awk "BEGIN { printf \"%.1f\", $t2 - $t1 }") s later" >&2
  if [ "$id" -lt $((nodes - 1)) ]; then sleep "$gap"; fi
done
SH
chmod +x "$work/rolling-restart.sh"
export BIN=$bin WORK=$work MEMORY=$memory

# run NAME: one cluster, one replay.
run() {
  local name=$1 nodes=$NODES handover=true event="" dir="$work/$1"
  case $name in
    *-nohandover) handover=false;;
  esac
  case $name in
    join*|ctl-join) nodes=$((NODES - 1));;
  esac
  mkdir -p "$dir"
  "$work/start-node.sh" "$dir" 0 "$handover"
  local seed
  seed=$(cat "$dir/n0.addr")
  for i in $(seq 1 $((nodes - 1))); do "$work/start-node.sh" "$dir" "$i" "$handover" "$seed"; done
  for _ in $(seq 300); do
    n=$("$bin/kvpool" -e "tcp://$seed" cluster status --json | grep -o '"state":"serving"' | wc -l)
    [ "$n" -eq "$nodes" ] && break; sleep 0.1
  done
  case $name in
    drain*) event="$bin/kvpool -e tcp://$seed cluster drain $((NODES - 1)) --wait --cluster-secret-file $dir/n0/cluster.secret";;
    join*) event="$work/start-node.sh $dir $((NODES - 1)) $handover $seed wait";;
    rolling) event="$work/rolling-restart.sh $dir $NODES $handover ${ROLLING_GAP:-30}";;
  esac
  local ev=()
  [ -n "$event" ] && ev=(--run "$event")
  timeout 3600 "$bin/kvpool-bench" elastic --endpoint "tcp://$seed" --block-bytes "$BLOCK" \
    --at "$AT" --label "$name" --csv "$dir/elastic.csv" ${ELASTIC_ARGS:-} "${ev[@]}" \
    > "$dir/table.txt"
  cat "$dir/pids" | xargs -r kill 2>/dev/null || true
}

echo "elastic: $NODES nodes x $CAPACITY blocks of $BLOCK, event at $AT s; runs: $RUNS"
if [ "${PARALLEL:-0}" = 1 ]; then
  jobs=()
  for r in $RUNS; do run "$r" & jobs+=($!); done
  for j in "${jobs[@]}"; do wait "$j"; done
else
  for r in $RUNS; do run "$r"; done
fi
first=1
for r in $RUNS; do
  cat "$work/$r/table.txt"
  if [ $first = 1 ]; then cat "$work/$r/elastic.csv"; first=0; else tail -n +2 "$work/$r/elastic.csv"; fi >> "$OUT/elastic.csv"
done
echo "wrote $OUT/elastic.csv"

"""Latency of looking up a 32k-token prefix across a 4-daemon cluster, next to redis EXISTS.

A prefix of 32 768 tokens is 2 048 keys at 16-token pages (``kvpool.block_hashes``);
an engine asks how many leading blocks are cached with ``Client.match_prefix``, which sends one
request per daemon owning any of the keys, in parallel. This starts 4 kvpoold daemons forming
one cluster (static membership: node 0 first, nodes 1-3 with ``--peer`` node 0 and its cluster
secret, as docs/OPERATIONS.md starts a cluster), stores the 2 048 blocks, and times, in one run:

* ``match_prefix`` of the 2 048 keys (all present: the whole prefix is looked up), with the
  same-host path on (the default) and off, and ``match_prefix`` of one key (one round trip to
  one daemon: the floor under the 2 048-key lookup);
* one redis ``EXISTS`` of one key (one round trip to redis-server, through redis-py), and one
  ``EXISTS`` naming all 2 048 keys (it answers a count, not the leading run);

each ``--repeats`` times, interleaved in rounds, as the median and the 99th percentile. It checks
from every daemon's ``/metrics`` that each lookup cost exactly one ``exists`` request per daemon.

Usage: python python/bench/lookup_rtt.py --kvpoold target/release/kvpoold
[--redis-server redis-server] [--repeats 2000] [--out bench-out/lookup-rtt.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import kvpool
import redis
from _daemons import Kvpoold, start_redis

TOKENS = 32768
PAGE = 16


class Daemon(Kvpoold):
    """One kvpoold of the cluster, joined through ``seed`` (the first one)."""

    def __init__(self, binary: str, node_id: int, seed: Daemon | None):
        extra = ["--node-id", str(node_id)]
        extra += ["--heartbeat-ms", "100", "--down-after-ms", "1000"]
        if seed is not None:
            secret = os.path.join(seed.dir, "cluster.secret")
            extra += ["--peer", seed.tcp, "--cluster-secret-file", secret]
        super().__init__(binary, "64MiB", extra, prefix=f"kvpool-rtt-{node_id}-")
        self.metrics = self.addrs["metrics"]

    def counter(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        body = urllib.request.urlopen(
            f"http://{self.metrics}/metrics", timeout=5
        ).read()
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in body.decode().splitlines():
            m = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
            if m and m.group(1) == name and all(w in (m.group(2) or "") for w in want):
                return float(m.group(3))
        return 0.0


def summary(ns: list[int]) -> dict:
    xs = sorted(ns)
    return {
        "median_us": statistics.median(xs) / 1e3,
        "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] / 1e3,
        "min_us": xs[0] / 1e3,
        "n": len(xs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--kvpoold", default=os.environ.get("KVPOOLD", "target/release/kvpoold")
    )
    ap.add_argument(
        "--redis-server", default=shutil.which("redis-server") or "redis-server"
    )
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", default="bench-out/lookup-rtt.json")
    a = ap.parse_args()

    daemons: list[Daemon] = []
    rproc = None
    try:
        daemons.append(Daemon(a.kvpoold, 0, None))
        for i in range(1, a.nodes):
            daemons.append(Daemon(a.kvpoold, i, daemons[0]))
        rproc, rport = start_redis(a.redis_server)
        result = run(a, daemons, rport)
    finally:
        for d in daemons:
            d.stop()
        if rproc is not None:
            rproc.terminate()
            rproc.wait(10)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}")


def run(a: argparse.Namespace, daemons: list[Daemon], rport: int) -> dict:
    tokens = [(j * 7919 + 13) % 128256 for j in range(TOKENS)]
    keys = kvpool.block_hashes(tokens, PAGE, model="lookup-rtt-bench", dtype="bf16")
    assert len(keys) == TOKENS // PAGE
    url = f"tcp://{daemons[0].tcp}"
    spread = spread_keys(url, keys, daemons)
    print(f"{len(daemons)} daemons, keys per daemon {[int(n) for n in spread]}")

    clients = {
        "same-host": kvpool.Client(url, timeout=5.0),
        "tcp": kvpool.Client(url, timeout=5.0, same_host=False),
    }
    r = redis.Redis(port=rport)
    r.mset({k: b"x" * 64 for k in keys})
    one = keys[len(keys) // 2]

    local, remote = clients["same-host"], clients["tcp"]
    calls = {
        "kvpool match_prefix, 2048 keys, same-host": lambda: local.match_prefix(keys),
        "kvpool match_prefix, 2048 keys, tcp": lambda: remote.match_prefix(keys),
        "kvpool match_prefix, 1 key": lambda: remote.match_prefix([one]),
        "redis EXISTS, 1 key": lambda: r.exists(one),
        "redis EXISTS, 2048 keys": lambda: r.exists(*keys),
    }
    expect = [len(keys), len(keys), 1, 1, len(keys)]
    for (name, f), want in zip(calls.items(), expect):  # warm up; check every answer
        for _ in range(20):
            got = f()
        if got != want:
            sys.exit(f"{name}: answered {got}, expected {want}")

    requests = requests_per_lookup(calls, daemons)
    times = time_calls(calls, a.repeats)
    for c in clients.values():
        c.close()

    rows = {name: summary(ts) for name, ts in times.items()}
    print_table(rows)
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "daemons": len(daemons),
        "keys": len(keys),
        "keys_per_daemon": spread,
        "exists_requests_per_lookup_per_daemon": requests,
        "calls": rows,
    }


def spread_keys(url: str, keys: list, daemons: list[Daemon]) -> list:
    """Stores the keys until every node owns a share of them (a node is joining for two
    heartbeats, then serving; a client's view follows within a heartbeat or two); returns
    the objects per daemon."""
    # Every node must own a share of the keys before the timing starts.
    deadline = time.monotonic() + 30
    while True:
        with kvpool.Client(url, timeout=5.0) as c:
            c.clear()
            c.write_many(keys, [b"x" * 64] * len(keys))
            ok = c.match_prefix(keys) == len(keys)
        spread = [d.counter("kvpool_objects") for d in daemons]
        if ok and all(n > 0 for n in spread):
            return spread
        if time.monotonic() > deadline:
            sys.exit(f"the cluster never spread the keys over every node: {spread}")
        time.sleep(0.3)


def requests_per_lookup(calls: dict, daemons: list[Daemon]) -> dict:
    """Requests per lookup, per daemon, of each kvpool call, from the daemons' own
    counters."""
    requests = {}
    for name, f in calls.items():
        if not name.startswith("kvpool"):
            continue
        before = [d.counter("kvpool_operations_total", op="exists") for d in daemons]
        for _ in range(50):
            f()
        after = [d.counter("kvpool_operations_total", op="exists") for d in daemons]
        requests[name] = [(y - x) / 50 for x, y in zip(before, after)]
        print(f"{name}: exists requests per lookup, per daemon: {requests[name]}")
    return requests


def time_calls(calls: dict, repeats: int) -> dict[str, list[int]]:
    """Nanoseconds of each call, about ``repeats`` of each in 20 interleaved rounds."""
    times: dict[str, list[int]] = {k: [] for k in calls}
    rounds = 20
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, f in calls.items():
            ts = times[name]
            for _ in range(per_round):
                t = time.perf_counter_ns()
                f()
                ts.append(time.perf_counter_ns() - t)
    return times


def print_table(rows: dict) -> None:
    base = rows["redis EXISTS, 1 key"]["median_us"]
    print(
        f"\n{'call':<44} {'median us':>10} {'p99 us':>10} {'x redis EXISTS 1 key':>22}"
    )
    for name, s in rows.items():
        ratio = s["median_us"] / base
        print(f"{name:<44} {s['median_us']:10.1f} {s['p99_us']:10.1f} {ratio:21.1f}x")


if __name__ == "__main__":
    main()

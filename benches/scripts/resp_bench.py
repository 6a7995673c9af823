#!/usr/bin/env python3
"""redis-benchmark against kvpoold's RESP door and against redis-server, same flags, same run.

For each value size (4 KiB, 1 MiB) and pipelining (none, -P 16) it runs redis-benchmark's SET
and GET against each server, interleaved (``--pairs N``: N pairs in a row, the order of the two
servers alternating), and prints JSON with the requests per second of both in every pair and
kvpoold's ratio to redis-server per pair as min / median / max (goal: the minimum >= 1.0). redis-server runs with no persistence
(--save "" --appendonly no); kvpoold is the release build (target/release/kvpoold, or
$KVPOOLD), with the pool on anonymous memory.

    cargo build --release -p kvpool-server
    python3 benches/scripts/resp_bench.py [--quick] [--pairs 5] > resp_bench.json
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def bench(
    port: int, test: str, size: int, pipeline: int, requests: int, clients: int
) -> float:
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", test]
        + ["-d", str(size), "-P", str(pipeline), "-n", str(requests)]
        + ["-c", str(clients), "--csv", "-q"],
        capture_output=True,
        timeout=600,
        check=True,
    )
    text = out.stdout.decode()
    if "rror" in text or "rror" in out.stderr.decode():
        raise RuntimeError(f"redis-benchmark reported errors: {text} {out.stderr!r}")
    rows = [r for r in csv.reader(io.StringIO(text)) if r and r[0] != "test"]
    return float(rows[0][1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="runs of each test against both servers, one pair after the other (1-20)",
    )
    args = ap.parse_args()
    if not 1 <= args.pairs <= 20:
        print("--pairs takes 1 to 20", file=sys.stderr)
        return 2
    for tool in ("redis-benchmark", "redis-server"):
        if not shutil.which(tool):
            print(
                f"{tool} is missing (apt-get install redis-tools redis-server)",
                file=sys.stderr,
            )
            return 2
    kvpoold = Path(os.environ.get("KVPOOLD", REPO / "target" / "release" / "kvpoold"))
    data = Path(tempfile.mkdtemp(prefix="kvpool-resp-bench-"))
    kv_port, redis_port = free_port(), free_port()
    procs = start_servers(kvpoold, data, kv_port, redis_port)
    try:
        wait_port(kv_port)
        wait_port(redis_port)
        results = run_all(kv_port, redis_port, 10 if args.quick else 1, args.pairs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(data, ignore_errors=True)
    json.dump(
        {"tool": "redis-benchmark", "cpus": os.cpu_count(), "results": results},
        sys.stdout,
        indent=2,
    )
    print()
    return 0


def start_servers(
    kvpoold: Path, data: Path, kv_port: int, redis_port: int
) -> list[subprocess.Popen]:
    """kvpoold with its RESP door on ``kv_port`` and redis-server on ``redis_port``, both
    keeping their files under ``data``."""
    return [
        subprocess.Popen(
            [
                str(kvpoold),
                "--data-dir",
                str(data),
                "--memory",
                "2GiB",
                "--backing",
                "anonymous",
            ]
            + ["--tcp", "127.0.0.1:0", "--quic", "", "--metrics", ""]
            + ["--resp", f"127.0.0.1:{kv_port}"],
            stdout=subprocess.DEVNULL,
            env=dict(os.environ, KVPOOL_LOG="warn"),
        ),
        subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(redis_port),
                "--save",
                "",
                "--appendonly",
                "no",
            ]
            + ["--bind", "127.0.0.1", "--dir", str(data)],
            stdout=subprocess.DEVNULL,
        ),
    ]


def run_all(kv_port: int, redis_port: int, scale: int, pairs: int) -> list[dict]:
    """Every size, pipelining and test against both servers, ``scale`` times fewer requests
    than the full run, ``pairs`` times; each result printed to stderr as it comes."""
    results = []
    for size, clients, requests in ((4096, 50, 200_000), (1 << 20, 8, 4_000)):
        for pipeline in (1, 16):
            for test in ("set", "get"):
                n = max(requests // scale, 100)
                redis_rps, kv_rps = [], []
                for i in range(pairs):
                    # The same flags against both; which goes first alternates.
                    order = [(redis_port, redis_rps), (kv_port, kv_rps)]
                    for port, out in order if i % 2 == 0 else order[::-1]:
                        out.append(bench(port, test, size, pipeline, n, clients))
                ratios = sorted(k / r for k, r in zip(kv_rps, redis_rps))
                results.append(
                    {
                        "test": test.upper(),
                        "value_bytes": size,
                        "pipeline": pipeline,
                        "clients": clients,
                        "requests": n,
                        "redis_server_rps": redis_rps,
                        "kvpoold_rps": kv_rps,
                        "ratio": round(statistics.median(ratios), 3),
                        "ratio_min": round(ratios[0], 3),
                        "ratio_max": round(ratios[-1], 3),
                        "goal_met": ratios[0] >= 1.0,
                    }
                )
                print(json.dumps(results[-1]), file=sys.stderr)
    return results


if __name__ == "__main__":
    sys.exit(main())

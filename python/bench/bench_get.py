"""Python get throughput of 2 MiB values, written as JSON.

Two ratios, each measured in one run, side by side:

* same host: ``Client.get_into`` (registered numpy buffer, Mooncake form) and
  ``Client.read_into`` against ``numpy.copyto`` of the same bytes (goal >= 0.85x);
* over TCP: ``Client.get_into`` with the same-host path off (a client that is not on the
  node's host) against redis-py ``GET`` from a redis-server holding the same values
  (goal >= 3x).

Usage: python bench_get.py --kvpoold target/release/kvpoold [--redis-server redis-server]
[--values 64] [--rounds 5] [--out bench-out/python-get.json]

It starts its own kvpoold (on free loopback ports, data in a temporary directory under
/dev/shm) and redis-server (no persistence); both are stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time

from _daemons import Kvpoold, start_redis

# numpy's OpenBLAS starts one spinning thread per core on import; on a small machine they steal
# the cores the client and kvpoold run on. Nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import kvpool
import numpy as np

VALUE = 2 << 20


def rate(fn, n_values: int, rounds: int) -> dict:
    """Best and median GB/s of ``rounds`` passes of ``fn(i)`` over every value."""
    for i in range(n_values):  # warm up: every value once
        fn(i)
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(n_values):
            fn(i)
        per.append(time.perf_counter() - t)
    per.sort()
    gb = n_values * VALUE / 1e9
    return {
        "best_gbps": gb / per[0],
        "median_gbps": gb / per[len(per) // 2],
        "median_us_per_value": per[len(per) // 2] / n_values * 1e6,
    }


def main() -> None:
    a = parse_args()

    import redis  # redis-py

    n = a.values
    rng = np.random.default_rng(7)
    values = [rng.integers(0, 256, VALUE, dtype=np.uint8) for _ in range(n)]
    keys = [f"bench-{i}" for i in range(n)]
    dst = np.empty(VALUE, dtype=np.uint8)

    kvp = Kvpoold(a.kvpoold, "1GiB")
    tcp = kvp.tcp
    rp, rport = start_redis(a.redis_server)
    out: dict = {
        "value_bytes": VALUE,
        "values": n,
        "rounds": a.rounds,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    try:
        local = kvpool.Client(f"tcp://{tcp}", timeout=30.0)
        out["same_host"] = same_host(local, keys, values, dst, a.rounds)

        # Over TCP: a client with the same-host path off, as on another host.
        remote = kvpool.Client(f"tcp://{tcp}", timeout=30.0, same_host=False)
        r = redis.Redis(host="127.0.0.1", port=rport, protocol=2)
        out["tcp"] = over_tcp(remote, r, keys, values, dst, a.rounds)
        remote.close()
        local.close()
    finally:
        kvp.stop()
        rp.terminate()
        rp.wait(10)

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpoold", default="target/release/kvpoold")
    ap.add_argument(
        "--redis-server", default=shutil.which("redis-server") or "redis-server"
    )
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench-out/python-get.json")
    return ap.parse_args()


def same_host(local, keys: list, values: list, dst, rounds: int) -> dict:
    """``get_into`` and ``read_into`` on the same-host client ``local`` against
    ``numpy.copyto`` of the same bytes, after storing the values through it."""
    n = len(keys)
    assert local.is_local(), "the same-host path was expected"
    for k, v in zip(keys, values):
        local.write(k, v)
    assert local.register_buffer(dst.ctypes.data, dst.nbytes) == 0

    def copyto(i):
        np.copyto(dst, values[i])

    def get_into(i):
        assert local.get_into(keys[i], dst.ctypes.data, VALUE) == VALUE

    def read_into(i):
        local.read_into(keys[i], dst)

    same = {
        "numpy_copyto": rate(copyto, n, rounds),
        "get_into": rate(get_into, n, rounds),
        "read_into": rate(read_into, n, rounds),
    }
    get_into(3)
    assert np.array_equal(dst, values[3])
    base = same["numpy_copyto"]["median_gbps"]
    same["ratio_get_into_vs_copyto"] = same["get_into"]["median_gbps"] / base
    same["ratio_read_into_vs_copyto"] = same["read_into"]["median_gbps"] / base
    same["goal"] = 0.85
    return same


def over_tcp(remote, r, keys: list, values: list, dst, rounds: int) -> dict:
    """``get_into`` on ``remote`` (same-host path off) against redis-py ``GET`` from ``r``,
    after storing the values in redis-server."""
    n = len(keys)
    assert not remote.is_local()
    assert remote.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    for k, v in zip(keys, values):
        r.set(k, v.tobytes())

    def tcp_get_into(i):
        assert remote.get_into(keys[i], dst.ctypes.data, VALUE) == VALUE

    def redis_get(i):
        assert len(r.get(keys[i])) == VALUE

    tcp_res = {
        "kvpool_get_into": rate(tcp_get_into, n, rounds),
        "redis_py_get": rate(redis_get, n, rounds),
    }
    tcp_res["ratio_vs_redis"] = (
        tcp_res["kvpool_get_into"]["median_gbps"]
        / tcp_res["redis_py_get"]["median_gbps"]
    )
    tcp_res["goal"] = 3.0
    return tcp_res


if __name__ == "__main__":
    main()

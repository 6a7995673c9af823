"""A loop of same-host ``get_into`` calls of 2 MiB values, to profile (``perf record -g``).

Usage: python same_host_loop.py --kvpoold target/release/kvpoold [--values 32] [--rounds 20]
[--hold]

It starts its own kvpoold (data directory under /dev/shm, stopped at the end), stores
``--values`` random 2 MiB values, and gets each of them ``--rounds`` times into one registered
numpy array, printing the mean microseconds per value. With ``--hold`` the process keeps its
own copies of the values alive meanwhile (as bench_get.py does, and as an engine holds its KV
cache); without, they are freed once stored.
"""

from __future__ import annotations

import argparse
import os
import time

from _daemons import Kvpoold

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import kvpool
import numpy as np

VALUE = 2 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kvpoold", required=True)
    ap.add_argument("--values", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--hold", action="store_true", help="keep the stored values alive")
    a = ap.parse_args()
    daemon = Kvpoold(a.kvpoold, "1GiB", prefix="kvpool-loop-")
    try:
        c = kvpool.Client(f"tcp://{daemon.tcp}")
        keys = [f"k{i}" for i in range(a.values)]
        held = []
        for k in keys:
            v = np.random.randint(0, 255, VALUE, dtype=np.uint8)
            c.write(k, v)
            if a.hold:
                held.append(v)
        dst = np.ones(VALUE, dtype=np.uint8)
        assert c.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        start = time.perf_counter()
        for _ in range(a.rounds):
            for k in keys:
                assert c.get_into(k, dst.ctypes.data, VALUE) == VALUE
        per = (time.perf_counter() - start) / (a.rounds * len(keys))
        shown = "held" if a.hold else "freed"
        print(
            f"same-host get_into of 2 MiB, values {shown}: {per * 1e6:.0f} us per value"
        )
        c.close()
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()

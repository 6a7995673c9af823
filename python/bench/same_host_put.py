"""Same-host puts: a writer whose values go through its staging area (``staged``: the node
copies them into their allocations, so the writer's stores reach nothing else; docs/SECURITY.md,
"Same host"), the same client over the socket, and a plain copy of the same bytes into memory
of the process's own (``memcpy``, the limit), in one run.

One kvpoold, one registered buffer of ``--values`` random values of ``--size`` bytes, stored
with ``batch_put_from`` in batches of ``--batch`` keys, each round under fresh keys; the
contenders alternate round by round and the median of ``--rounds`` rounds is reported (the
first rounds fault the segment's pages in). The last staged value is read back and compared.

Usage: python python/bench/same_host_put.py --kvpoold target/release/kvpoold
[--size 2MiB] [--values 256] [--batch 32] [--rounds 9] [--out bench-out/same-host-put.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import kvpool
import numpy as np
from _daemons import Kvpoold

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size_of(s: str) -> int:
    for unit, n in UNITS.items():
        if s.endswith(unit):
            return int(s[: -len(unit)]) * n
    return int(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpoold", required=True)
    ap.add_argument("--size", default="2MiB")
    ap.add_argument("--values", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args()
    size = size_of(a.size)
    total = size * a.values
    memory = f"{max(2 * total, 256 << 20) >> 20}MiB"
    data = np.random.default_rng(1).integers(0, 255, size=total, dtype=np.uint8)
    ptr = data.ctypes.data
    node = Kvpoold(a.kvpoold, memory, [], prefix="kvpool-put-")
    # The limit: the same bytes copied once into memory of this process's own, faulted in.
    sink = np.ones(total, dtype=np.uint8)
    try:
        clients = {
            "staged": kvpool.Client("tcp://" + node.tcp),
            "socket": kvpool.Client("tcp://" + node.tcp, same_host=False),
        }
        for name, c in clients.items():
            if c.is_local() != (name != "socket"):
                sys.exit(f"{name}: the same-host path is not as it should be")
            assert c.register_buffer(ptr, data.nbytes) == 0
        rates: dict[str, list[float]] = {k: [] for k in [*clients, "memcpy"]}
        for r in range(a.rounds):
            t = time.perf_counter()
            np.copyto(sink, data)
            rates["memcpy"].append(total / (time.perf_counter() - t) / 2**30)
            for name, c in clients.items():
                t = time.perf_counter()
                for b in range(0, a.values, a.batch):
                    idx = range(b, min(b + a.batch, a.values))
                    keys = [f"{name}-{r}-{i}" for i in idx]
                    ptrs = [ptr + i * size for i in idx]
                    codes = c.batch_put_from(keys, ptrs, [size] * len(keys))
                    if any(codes):
                        sys.exit(f"{name}: put failed: {codes}")
                rates[name].append(total / (time.perf_counter() - t) / 2**30)
        out = np.zeros(size, dtype=np.uint8)
        staged = clients["staged"]
        assert staged.register_buffer(out.ctypes.data, size) == 0
        last = a.values - 1
        got = staged.get_into(f"staged-{a.rounds - 1}-{last}", out.ctypes.data, size)
        if got != size or not np.array_equal(out, data[last * size :]):
            sys.exit("a staged value read back differs")
    finally:
        node.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"same-host puts of {a.size}, {total >> 20} MiB a round, {a.rounds} rounds")
    for k, v in rates.items():
        runs = " ".join(f"{x:.2f}" for x in v)
        print(f"  {k:7s} median {med[k]:.2f} GiB/s   rounds {runs}")
    print(
        f"  staged / memcpy {med['staged'] / med['memcpy']:.2f}x, "
        f"staged / socket {med['staged'] / med['socket']:.2f}x (load {os.getloadavg()[0]:.1f})"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"size": size, "values": a.values, "rates_gib_s": rates}, f, indent=1
            )


if __name__ == "__main__":
    main()

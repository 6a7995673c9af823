"""Same-host puts: a writer that stores into a read-write mapping (``direct``) against one whose
values go through a staging area (``staged``: the node copies them into their allocations, so
the writer's stores reach nothing else; docs/SECURITY.md, "Same host"), and the same client
over the socket, in one run.

Two kvpoold (``memory.same_host_writes = "direct"`` and ``"staged"``), one registered buffer of
``--values`` random values of ``--size`` bytes, stored with ``batch_put_from`` in batches of
``--batch`` keys, each round under fresh keys; the contenders alternate round by round and the
median of ``--rounds`` rounds is reported (the first rounds fault the segments' pages in). The
last staged value is read back and compared.

Usage: python python/bench/same_host_put.py --kvpoold target/release/kvpoold
[--size 2MiB] [--values 256] [--batch 32] [--rounds 9] [--out bench-out/same-host-put.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
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


def node(binary: str, mode: str, memory: str) -> Kvpoold:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as cfg:
        cfg.write(f'[memory]\nsame_host_writes = "{mode}"\n')
    return Kvpoold(binary, memory, ["-c", cfg.name], prefix=f"kvpool-put-{mode}-")


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
    nodes = {m: node(a.kvpoold, m, memory) for m in ("direct", "staged")}
    try:
        clients = {
            "direct": kvpool.Client("tcp://" + nodes["direct"].tcp),
            "staged": kvpool.Client("tcp://" + nodes["staged"].tcp),
            "socket": kvpool.Client("tcp://" + nodes["direct"].tcp, same_host=False),
        }
        for name, c in clients.items():
            if c.is_local() != (name != "socket"):
                sys.exit(f"{name}: the same-host path is not as it should be")
            assert c.register_buffer(ptr, data.nbytes) == 0
        rates: dict[str, list[float]] = {k: [] for k in clients}
        for r in range(a.rounds):
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
        for n in nodes.values():
            n.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"same-host puts of {a.size}, {total >> 20} MiB a round, {a.rounds} rounds")
    for k, v in rates.items():
        runs = " ".join(f"{x:.2f}" for x in v)
        print(f"  {k:7s} median {med[k]:.2f} GiB/s   rounds {runs}")
    print(
        f"  staged / direct {med['staged'] / med['direct']:.2f}x, "
        f"staged / socket {med['staged'] / med['socket']:.2f}x (load {os.getloadavg()[0]:.1f})"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"size": size, "values": a.values, "rates_gib_s": rates}, f, indent=1
            )


if __name__ == "__main__":
    main()

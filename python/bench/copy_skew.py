"""The cost of a copy's skew: 2 MiB copied out of a /dev/shm mapping into a destination that sits
``skew`` bytes past the source modulo 4 KiB, by numpy in chunks (what glibc's memcpy does per
chunk size) and by kvpool's same-host ``get_into``.

Usage: python copy_skew.py --kvpoold target/release/kvpoold

It also times what a same-host get pays besides the copy: the lookup round trip and the xxh3
check of the value.

glibc copies blocks between a few KiB and its non-temporal threshold with ``rep movsb``, which is
several times slower when the skew is 1 to 63 bytes (4K aliasing); a large numpy array or torch
tensor starts 16 bytes past a page, and kvpool's objects are page-aligned. docs/BENCHMARKS.md
has the figures.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

from _daemons import Kvpoold

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import kvpool
import numpy as np

VALUE = 2 << 20
SKEWS = (0, 16, 48, 64)


def skewed(buf: np.ndarray, skew: int) -> np.ndarray:
    """A VALUE-byte view of ``buf`` starting ``skew`` bytes past a page."""
    off = (skew - buf.ctypes.data) % 4096
    return buf[off : off + VALUE]


def chunked_copies(values: int = 30) -> None:
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    try:
        os.ftruncate(fd, values * VALUE)
        m = mmap.mmap(fd, values * VALUE, mmap.MAP_SHARED)
        src = np.frombuffer(m, dtype=np.uint8)
        src[:] = np.random.randint(0, 255, src.size, dtype=np.uint8)
        dst_mem = np.ones(VALUE + 8192, dtype=np.uint8)
        print("numpy copies of 2 MiB out of /dev/shm, µs per 2 MiB")
        print("  skew  " + "  ".join(f"{c >> 10:>5} KiB" for c in (1, 2, 3, 64, 1024)))
        for skew in SKEWS:
            dst = skewed(dst_mem, skew)
            row = []
            for chunk in (1 << 10, 2 << 10, 3 << 10, 64 << 10, 1 << 20):
                t = time.perf_counter()
                for i in range(values):
                    s = src[i * VALUE : (i + 1) * VALUE]
                    for o in range(0, VALUE, chunk):
                        np.copyto(dst[o : o + chunk], s[o : o + chunk])
                row.append((time.perf_counter() - t) / values * 1e6)
            print(f"  {skew:>4}  " + "  ".join(f"{v:>9.0f}" for v in row))
        print("  (small chunks include numpy's per-call overhead)")
    finally:
        os.close(fd)
        os.unlink(path)


def kvpool_gets(kvpoold: str, values: int = 32, rounds: int = 10) -> None:
    daemon = Kvpoold(kvpoold, "1GiB", prefix="kvpool-skew-")
    try:
        c = kvpool.Client(f"tcp://{daemon.tcp}")
        keys = [f"k{i}" for i in range(values)]
        for k in keys:
            c.write(k, np.random.randint(0, 255, VALUE, dtype=np.uint8))
        mem = np.ones(VALUE + 8192, dtype=np.uint8)
        print(
            f"kvpool same-host get_into of 2 MiB (local={c.is_local()}), µs per value"
        )
        for skew in SKEWS:
            dst = skewed(mem, skew)
            assert c.register_buffer(dst.ctypes.data, VALUE) == 0
            t = time.perf_counter()
            for _ in range(rounds):
                for k in keys:
                    assert c.get_into(k, dst.ctypes.data, VALUE) == VALUE
            per = (time.perf_counter() - t) / (rounds * values) * 1e6
            c.unregister_buffer(dst.ctypes.data)
            print(f"  skew {skew:>4}: {per:.0f}")
        parts(c, keys[0])
        c.close()
    finally:
        daemon.stop()


def parts(c: kvpool.Client, key: str, n: int = 2000) -> None:
    """What a same-host get pays besides the copy: its lookup round trip (``exists`` takes
    the same one over the Unix socket) and the xxh3 check of 2 MiB (the ``xxhash`` package,
    the hash the client verifies with)."""
    t = time.perf_counter()
    for _ in range(n):
        c.exists(key)
    print(f"lookup round trip (exists): {(time.perf_counter() - t) / n * 1e6:.0f} µs")
    import xxhash

    a = np.random.randint(0, 255, VALUE, dtype=np.uint8)
    t = time.perf_counter()
    for _ in range(300):
        xxhash.xxh3_64(a)
    print(f"xxh3 of 2 MiB: {(time.perf_counter() - t) / 300 * 1e6:.0f} µs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kvpoold", required=True)
    a = ap.parse_args()
    chunked_copies()
    kvpool_gets(a.kvpoold)


if __name__ == "__main__":
    main()

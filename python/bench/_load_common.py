"""What every part of ``connector_load.py`` shares: the shape of the KV each connector loads
(4096 tokens of Llama-3-8B, bf16) and how a load is timed."""

from __future__ import annotations

import statistics
import time

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKENS = 4096
MIB = 1 << 20
GIB = 1 << 30


def best_of(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def summary(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {
        "best_gibps": nbytes / GIB / min(times),
        "median_gibps": nbytes / GIB / med,
        "best_ms": min(times) * 1e3,
        "median_ms": med * 1e3,
        "times_ms": [round(t * 1e3, 2) for t in times],
    }

"""Quick probes of eviction ideas on a trace's block chains, in Python, with the harness's hit
count (per request, the leading run of blocks found; then every block is touched or stored,
evicting as needed): the figures under "Other policies measured on the design data" in docs/EVICTION.md.

    python3 benches/scripts/eviction_probe.py split TRACE FIRST SECOND   # halves by time
    python3 benches/scripts/eviction_probe.py reuse TRACE          # reuse by position
    python3 benches/scripts/eviction_probe.py compare TRACE [CAPACITIES]

`reuse` prints, for each block's first appearance, how often it is found again later, by its
depth in the chain and by its distance from the request's end (log2 buckets). `compare` prints
LRU, LRU by request with the tail first ("chain"), W-TinyLFU (1 % window, segmented main,
admission by a decaying frequency count) and bimodal insertion ("bip8": a request's new blocks
go in at the LRU end unless the request is one of 1 in 8 drawn at random) against LRU. Design only on first halves; the second
halves are held out (docs/EVICTION.md, "The held-out split").
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter, OrderedDict, defaultdict


def load(path: str) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def split(path: str, first: str, second: str) -> None:
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    t = [json.loads(line)["timestamp"] for line in lines]
    mid = (t[0] + t[-1]) / 2
    with open(first, "w") as f:
        f.write("".join(line + "\n" for line, x in zip(lines, t) if x < mid))
    with open(second, "w") as f:
        f.write("".join(line + "\n" for line, x in zip(lines, t) if x >= mid))


def run(reqs: list[list[int]], cache) -> float:
    hits = total = 0
    for blocks in reqs:
        for b in blocks:
            if not cache.has(b):
                break
            hits += 1
        total += len(blocks)
        cache.request(blocks)
    return hits / total


class Lru:
    def __init__(self, cap: int):
        self.cap, self.d = cap, OrderedDict()

    def has(self, b: int) -> bool:
        return b in self.d

    def request(self, blocks: list[int]) -> None:
        for b in blocks:
            if b in self.d:
                self.d.move_to_end(b)
        for b in blocks:
            if b not in self.d:
                if len(self.d) >= self.cap:
                    self.d.popitem(last=False)
                self.d[b] = 1


class ChainLru:
    """LRU by request; within a request the root is the most recent and the tail the oldest."""

    def __init__(self, cap: int):
        self.cap, self.prev, self.next = cap, {}, {}
        self.head = self.tail = None

    def has(self, b: int) -> bool:
        return b in self.prev

    def _unlink(self, k: int) -> None:
        p, n = self.prev.pop(k), self.next.pop(k)
        if p is None:
            self.head = n
        else:
            self.next[p] = n
        if n is None:
            self.tail = p
        else:
            self.prev[n] = p

    def _after(self, a: int | None, k: int) -> None:
        """Links `k` just older than `a` (at the head when `a` is None)."""
        n = self.head if a is None else self.next[a]
        self.prev[k], self.next[k] = a, n
        if a is None:
            self.head = k
        else:
            self.next[a] = k
        if n is None:
            self.tail = k
        else:
            self.prev[n] = k

    def request(self, blocks: list[int]) -> None:
        cur = None
        for b in blocks:
            if b in self.prev:
                self._unlink(b)
            if len(self.prev) >= self.cap:
                self._unlink(self.tail)
            if cur is None or cur in self.prev:
                self._after(cur, b)
            else:
                self._after(self.tail, b)
            cur = b


class Bip:
    """LRU with bimodal insertion (Qureshi et al., ISCA'07), drawn per request so that a chain
    is kept or dropped whole: the new blocks of a request go in at the LRU end (tail out
    first) unless the request is drawn (probability `eps`), then at the MRU end. A block found
    again moves to the MRU end. Keeps a random part of a working set larger than the cache
    instead of cycling all of it through."""

    def __init__(self, cap: int, eps: float = 1 / 8, seed: int = 1):
        self.cap, self.d, self.eps = cap, OrderedDict(), eps
        self.rng = random.Random(seed)

    def has(self, b: int) -> bool:
        return b in self.d

    def request(self, blocks: list[int]) -> None:
        drawn = self.rng.random() < self.eps
        for b in reversed(blocks):
            if b in self.d:
                self.d.move_to_end(b)
        new = [b for b in blocks if b not in self.d]
        for b in reversed(new) if drawn else new:
            if len(self.d) >= self.cap:
                self.d.popitem(last=False)
            self.d[b] = 1
            if not drawn:
                self.d.move_to_end(b, last=False)


class Freq:
    """Reference counts halved every `10 × capacity` references (a decaying sketch)."""

    def __init__(self, cap: int):
        self.c: dict[int, int] = {}
        self.n, self.reset = 0, max(64, 10 * cap)

    def inc(self, b: int) -> None:
        self.c[b] = self.c.get(b, 0) + 1
        self.n += 1
        if self.n >= self.reset:
            self.n //= 2
            self.c = {k: v // 2 for k, v in self.c.items() if v > 1}

    def get(self, b: int) -> int:
        return self.c.get(b, 0)


class WTinyLfu:
    def __init__(self, cap: int, window: float = 0.01, protected: float = 0.8):
        self.wcap = max(1, int(cap * window))
        self.mcap = cap - self.wcap
        self.pcap = int(self.mcap * protected)
        self.win, self.prob, self.prot = OrderedDict(), OrderedDict(), OrderedDict()
        self.f = Freq(cap)

    def has(self, b: int) -> bool:
        return b in self.win or b in self.prob or b in self.prot

    def _touch(self, b: int) -> None:
        if b in self.win:
            self.win.move_to_end(b)
        elif b in self.prob:
            del self.prob[b]
            self.prot[b] = 1
            if len(self.prot) > self.pcap:
                k, _ = self.prot.popitem(last=False)
                self.prob[k] = 1
        else:
            self.prot.move_to_end(b)

    def _insert(self, b: int) -> None:
        self.win[b] = 1
        if len(self.win) <= self.wcap:
            return
        cand, _ = self.win.popitem(last=False)
        if len(self.prob) + len(self.prot) < self.mcap:
            self.prob[cand] = 1
            return
        q = self.prob if self.prob else self.prot
        victim = next(iter(q))
        if self.f.get(cand) > self.f.get(victim):
            del q[victim]
            self.prob[cand] = 1

    def request(self, blocks: list[int]) -> None:
        for b in blocks:
            self.f.inc(b)
        for b in blocks:
            if self.has(b):
                self._touch(b)
        for b in blocks:
            if not self.has(b):
                self._insert(b)


def reuse(path: str) -> None:
    reqs = load(path)
    found_again, seen = set(), set()
    for blocks in reqs:
        for b in blocks:
            if b not in seen:
                break
            found_again.add(b)
        seen.update(blocks)
    by_depth, by_end = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    seen = set()
    for blocks in reqs:
        n = len(blocks)
        for d, b in enumerate(blocks):
            if b in seen:
                continue
            seen.add(b)
            for table, k in ((by_depth, d), (by_end, n - 1 - d)):
                row = table[min(k.bit_length(), 8)]
                row[0] += 1
                row[1] += b in found_again
    for name, table in (("depth", by_depth), ("from the end", by_end)):
        rows = [f"{k}:{v[1] / v[0]:.3f} (n={v[0]})" for k, v in sorted(table.items())]
        print(f"{path}: found again, by log2 {name}: " + "  ".join(rows))
    print(f"{path}: blocks {sum(map(len, reqs))}, distinct {len(Counter(seen))}")


def compare(path: str, caps: list[int]) -> None:
    reqs = load(path)
    for cap in caps:
        lru = run(reqs, Lru(cap))
        row = [f"lru {lru * 100:.2f}%"]
        for name, make in (("chain", ChainLru), ("w-tinylfu", WTinyLfu), ("bip8", Bip)):
            r = run(reqs, make(cap))
            row.append(f"{name} {r * 100:.2f}% ({r / lru if lru else 0:.2f}x)")
        print(f"{path} {cap}: " + "  ".join(row))


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "split" and len(sys.argv) == 5:
        split(path, sys.argv[3], sys.argv[4])
    elif cmd == "reuse":
        reuse(path)
    elif cmd == "compare":
        caps = sys.argv[3] if len(sys.argv) > 3 else "200,500,1000,2000,5000"
        compare(path, [int(c) for c in caps.split(",")])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

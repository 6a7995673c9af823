"""Loads 4096 tokens of Llama-3-8B-shaped KV (512 MiB bf16) into LMCache's MP server storage from
its L2 tier: kvpool on the same host and over loopback TCP, LMCache's own file-system adapter,
and a memcpy of the same bytes.

Usage: python lmcache_mp_load.py --kvpoold target/release/kvpoold [--rounds 5]
[--fs-dir /var/tmp] [--out bench-out/lmcache-mp-load.json]

One run, one kvpoold of its own (data directory under /dev/shm, loopback ports, stopped at the
end). Each L2 tier is one LMCache ``StorageManager`` built from ``lmcache server``'s own flags
(``--l1-size-gb 1 --eviction-policy LRU --l2-adapter <JSON>``), with that tier as its only L2
adapter:

* ``kvpool same host``: the ``plugin`` adapter ``kvpool.lmcache_mp.KvpoolL2Adapter`` (loads are
  one copy out of kvpoold's mapped memory into LMCache's registered L1);
* ``kvpool TCP``: the same with ``same_host: false`` (every byte over the loopback socket);
* ``LMCache fs``: LMCache's ``fs_native`` adapter (its C++ file connector; one file per chunk)
  in a directory under ``--fs-dir`` (a disk, not tmpfs); the files are in the page cache after
  the first round, as on a server that has memory to spare.

The KV (16 chunks of 256 tokens, LMCache's KV_2LTD layout ``[2, 32, 256, 1024]`` bf16, 32 MiB
each) is written into each manager's L1 and stored to its L2 by LMCache's StoreController.
A measured load is what the server does when a request's prefix is in L2 only: the L1 copies
are deleted first (not timed), then ``submit_prefetch_task`` until ``wait_prefetch_status``
says done (LMCache's PrefetchController: the L2 lookup, L1 reservation and L2 load of all 16
chunks). Every round measures, in this order, a single-thread memcpy of 512 MiB
(``ctypes.memmove`` between two preallocated, pre-touched buffers), then each tier. Min, median
and max over the rounds; the loaded bytes are compared with the stored ones after the last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch
from _daemons import Kvpoold
from _load_baselines import Memcpy
from _load_common import GIB, HEAD_DIM, HEADS, LAYERS, TOKENS
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args as lmcache_server_args
from lmcache.v1.distributed.storage_manager import StorageManager

CHUNK = 256
MODEL = "meta-llama/Meta-Llama-3-8B"
LAYOUT = MemoryLayoutDesc(
    shapes=[torch.Size([2, LAYERS, CHUNK, HEADS * HEAD_DIM])], dtypes=[torch.bfloat16]
)
KEYS = [
    ObjectKey(chunk_hash=i.to_bytes(4, "big") * 8, model_name=MODEL, kv_rank=0)
    for i in range(TOKENS // CHUNK)
]


def main() -> None:
    a = parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in ("kvpool", "lmcache"):
        logging.getLogger(name).setLevel(logging.WARNING)
    fs_dir = tempfile.mkdtemp(prefix="kvpool-lmcache-fs-", dir=a.fs_dir)
    daemon = Kvpoold(a.kvpoold, a.memory, prefix="kvpool-lmcache-mp-")
    tiers: dict[str, Tier] = {}
    try:
        t0 = time.perf_counter()
        kvpool = {"type": "plugin", "module_path": "kvpool.lmcache_mp"}
        kvpool["class_name"] = "KvpoolL2Adapter"
        url = f"kvpool://{daemon.tcp}"
        specs = {
            "kvpool same host": {**kvpool, "adapter_params": {"url": url}},
            "kvpool TCP": {
                **kvpool,
                "adapter_params": {"url": url, "same_host": False},
            },
            "LMCache fs": {"type": "fs_native", "base_path": fs_dir},
        }
        for name, spec in specs.items():
            tiers[name] = Tier(spec)
            tiers[name].store()
        print(
            f"set up and stored {len(KEYS)} chunks in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        nbytes = tiers["kvpool same host"].nbytes
        memcpy = Memcpy(nbytes)
        runs = {"memcpy": memcpy.run, **{n: t.load for n, t in tiers.items()}}
        times, load_avg = measure_rounds(runs, a.rounds)
        checks = {n: t.check() for n, t in tiers.items()}
        local = tiers["kvpool same host"].adapter_is_local()
    finally:
        for t in tiers.values():
            t.close()
        daemon.stop()
        shutil.rmtree(fs_dir, ignore_errors=True)

    out = {
        "bytes": nbytes,
        "tokens": TOKENS,
        "chunk_tokens": CHUNK,
        "rounds": a.rounds,
        "same_host_path_used": local,
        "load_average_1m": [round(x, 2) for x in load_avg],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bytes_verified": checks,
        "results": results(times, nbytes),
    }
    print_table(out)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    if not all(checks.values()):
        sys.exit(f"loaded bytes differ from the stored ones: {checks}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpoold", default="target/release/kvpoold")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", default="2GiB", help="kvpoold's --memory")
    ap.add_argument(
        "--fs-dir",
        default="/var/tmp",
        help="where LMCache's fs adapter keeps its files",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args()


class Tier:
    """One LMCache MP storage manager whose only L2 adapter is ``spec``."""

    def __init__(self, spec: dict):
        flags = ["--l1-size-gb", "1", "--eviction-policy", "LRU"]
        config = lmcache_server_args(flags + ["--l2-adapter", json.dumps(spec)])
        # Each manager its own L1 shared memory (the server's --shm-name).
        config.l1_manager_config.memory_config.shm_name = (
            f"kvpool_bench_{uuid.uuid4().hex}"
        )
        self.sm = StorageManager(config)
        self.adapter = self.sm.l2_adapters()[0][1]
        self.raws: list[torch.Tensor] = []
        self.nbytes = 0

    def store(self) -> None:
        """Writes the KV into L1 (seeded random bytes, the same for every tier), waits until
        the L2 adapter holds all of it, then empties L1."""
        objs = self.sm.reserve_write(KEYS, LAYOUT)
        assert len(objs) == len(KEYS), "L1 too small"
        g = torch.Generator().manual_seed(7)
        for k in KEYS:
            raw = objs[k].tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
            self.raws.append(raw.clone())
        self.nbytes = sum(r.numel() for r in self.raws)
        self.sm.finish_write(KEYS)
        deadline = time.monotonic() + 300
        while self.adapter.get_usage().total_bytes_used < self.nbytes:
            if self.adapter.report_status().get("store_failures"):
                sys.exit(f"storing the KV failed: {self.adapter.report_status()}")
            if time.monotonic() > deadline:
                sys.exit(f"{type(self.adapter).__name__} did not store the KV")
            time.sleep(0.05)
        self.evict_l1()

    def evict_l1(self) -> None:
        _, skipped = self.sm.delete_l1_keys(KEYS)
        assert skipped == 0, "L1 keys still locked"

    def prefetch(self):
        spec = PrefetchTaskSpec(
            key_groups=[
                GroupedObjectKeys(keys=KEYS, object_group_id=0, layout_desc=LAYOUT)
            ]
        )
        handle = self.sm.submit_prefetch_task(spec)
        if not self.sm.wait_prefetch_status(handle, 120):
            sys.exit("a prefetch did not finish in 120 s")
        result = self.sm.query_prefetch_status(handle)
        assert result is not None
        return result

    def load(self) -> None:
        """The timed part: the prefetch of every chunk from L2 into L1."""
        result = self.prefetch()
        if result.l2_hit_count != len(KEYS):
            sys.exit(f"only {result.l2_hit_count} of {len(KEYS)} chunks came from L2")
        self.sm.finish_read_prefetched(KEYS, l1_owners=result.l1_owners)
        self.evict_l1()

    def check(self) -> bool:
        """Loads once more and compares L1's bytes with the stored ones."""
        result = self.prefetch()
        ok = result.l2_hit_count == len(KEYS)
        if ok:
            with self.sm.read_prefetched_results(KEYS, result.l1_owners) as objs:
                ok = objs is not None and all(
                    torch.equal(o.tensor.view(torch.uint8), r)
                    for o, r in zip(objs, self.raws)
                )
        self.sm.finish_read_prefetched(KEYS, l1_owners=result.l1_owners)
        self.evict_l1()
        return ok

    def adapter_is_local(self) -> bool:
        store = getattr(self.adapter, "store", None)
        return bool(store is not None and store.is_local)

    def close(self) -> None:
        self.sm.close()


def measure_rounds(
    runs: dict, rounds: int
) -> tuple[dict[str, list[float]], list[float]]:
    """One unrecorded pass of every load, then ``rounds`` rounds of all of them in order;
    each load's times and the 1-minute load average before and after each round."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    load_avg = [os.getloadavg()[0]]
    for r in range(rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        load_avg.append(os.getloadavg()[0])
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return times, load_avg


def results(times: dict[str, list[float]], nbytes: int) -> dict:
    """Per load: min, median and max time, GiB/s at the median, and the median's ratio to
    memcpy's."""
    res = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        res[name] = {
            "min_ms": min(ts) * 1e3,
            "median_ms": med * 1e3,
            "max_ms": max(ts) * 1e3,
            "median_gibps": nbytes / GIB / med,
            "times_ms": [round(t * 1e3, 2) for t in ts],
        }
    base = res["memcpy"]["median_ms"]
    for r in res.values():
        r["median_vs_memcpy"] = r["median_ms"] / base
    return res


def print_table(out: dict) -> None:
    la = out["load_average_1m"]
    print(
        f"{out['bytes'] >> 20} MiB ({out['tokens']} tokens of Llama-3-8B KV, bf16, "
        f"{out['chunk_tokens']}-token chunks), {out['rounds']} rounds; load average "
        f"{min(la):.2f}-{max(la):.2f}; same-host path used: {out['same_host_path_used']}; "
        f"bytes verified: {out['bytes_verified']}"
    )
    hdr = (
        f"{'L2 tier':<17} {'min ms':>8} {'median ms':>9} {'max ms':>8} "
        f"{'median GiB/s':>12} {'x memcpy':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, r in out["results"].items():
        print(
            f"{name:<17} {r['min_ms']:>8.1f} {r['median_ms']:>9.1f} {r['max_ms']:>8.1f} "
            f"{r['median_gibps']:>12.2f} {r['median_vs_memcpy']:>8.2f}"
        )


if __name__ == "__main__":
    main()

"""Loads 4096 tokens of Llama-3-8B-shaped KV (512 MiB bf16) through vLLM's own offloading path,
with kvpool as the secondary tier (same host and over loopback TCP), against vLLM's CPU tier
alone.

Usage: python vllm_offload_load.py --kvpoold target/release/kvpoold [--rounds 3]
[--out bench-out/vllm-offload-load.json]

One run, one kvpoold of its own (data directory under /dev/shm, loopback ports, stopped at the
end). Each engine is vLLM's real ``Scheduler`` with the ``OffloadingConnector`` built from a
``--kv-transfer-config`` (``TieringOffloadingSpec``, 272-chunk CPU tier in shared memory), and
a worker-role connector on 272 16-token blocks of per-layer KV tensors from vLLM's
``allocate_kv_cache``; the GPU-to-CPU-tier copy, CUDA in vLLM, is memmoves here
(``kvpool._vllm_offload_host``). A writer engine stores the prompt's 256 chunks (one 2 MiB
block of all 32 layers each) through its CPU tier into kvpool first. Then each round times,
in this order, one load per variant into a fresh engine (building it is not timed), from
``add_request`` of a 4097-token prompt until the scheduler schedules it with 4096 tokens
computed (its blocks in the KV tensors):

* ``CPU tier alone``: no secondary tier; the engine computed the prompt once, its chunks are
  in the CPU tier, the GPU prefix cache was reset; the load is the CPU tier's hit and copy;
* ``kvpool same host`` / ``kvpool TCP``: a fresh engine whose CPU tier is empty: vLLM's async
  lookup asks kvpool (one presence call), promotes the chunks from kvpool into CPU-tier slots
  (the tier loads them straight into the registered rows), then the same copy.

The engine loop is vLLM's: a step that runs no forward while requests wait sleeps 1 ms. Min,
median and max over the rounds; ratios of the medians; and the median time spent inside
kvpool's batched loads (the promotion's part). Every load's blocks are compared with the written
bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from _daemons import Kvpoold

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from _load_common import GIB, HEAD_DIM, HEADS, TOKENS
from _load_vllm_offload import BLOCK, CHUNK, NAMES, NUM_BLOCKS, OffloadEngine, model_dir

VARIANTS = ("CPU tier alone", "kvpool same host", "kvpool TCP")


def main() -> None:
    a = parse_args()
    quiet()
    tmp = tempfile.mkdtemp(prefix="kvpool-vllm-offload-")
    daemon = Kvpoold(a.kvpoold, a.memory, prefix="kvpool-vllm-offload-")
    url = f"tcp://{daemon.tcp}"
    try:
        path = model_dir(tmp)
        g = torch.Generator().manual_seed(1)
        shape = (TOKENS // BLOCK, HEADS, BLOCK, 2 * HEAD_DIM)  # vLLM's page of a block
        source = {
            n: torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(
                torch.bfloat16
            )
            for n in NAMES
        }
        prompt = torch.randint(1, 999, (TOKENS + 1,), generator=g).tolist()
        t0 = time.perf_counter()
        writer = OffloadEngine(path, url, True, source)
        writer.add("write", prompt)
        writer.run("write")
        writer.settle()
        stored = writer.tier.stats()["stores"]
        writer.close()
        assert stored == TOKENS // BLOCK, stored
        print(
            f"stored {stored} chunks in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        steps: dict[str, list[int]] = {v: [] for v in VARIANTS}
        in_kvpool: dict[str, list[float]] = {v: [] for v in VARIANTS}
        verified = {v: True for v in VARIANTS}
        for r in range(a.rounds):
            for v in VARIANTS:
                sec, n, kv_sec, ok = load_once(v, path, url, source, prompt)
                times[v].append(sec)
                steps[v].append(n)
                in_kvpool[v].append(kv_sec)
                verified[v] = verified[v] and ok
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    nbytes = TOKENS // BLOCK * CHUNK
    base = statistics.median(times["CPU tier alone"])
    out = {
        "bytes": nbytes,
        "tokens": TOKENS,
        "rounds": a.rounds,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "bytes_verified": verified,
        "results": {
            v: {
                "min_ms": min(t) * 1e3,
                "median_ms": statistics.median(t) * 1e3,
                "max_ms": max(t) * 1e3,
                "median_gibps": nbytes / GIB / statistics.median(t),
                "median_vs_cpu_tier": statistics.median(t) / base,
                "engine_steps": steps[v],
                "median_ms_in_kvpool_loads": statistics.median(in_kvpool[v]) * 1e3,
                "times_ms": [round(x * 1e3, 1) for x in t],
            }
            for v, t in times.items()
        },
    }
    print_table(out)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    if not all(verified.values()):
        sys.exit(f"loaded bytes differ from the written ones: {verified}")


def load_once(
    variant: str, path: str, url: str, source: dict, prompt: list[int]
) -> tuple[float, int, float, bool]:
    """One timed load of the prompt's 256 blocks into a fresh engine; (seconds, engine
    steps, seconds inside kvpool's loads, whether the blocks hold the written bytes)."""
    kvpool = variant != "CPU tier alone"
    e = OffloadEngine(
        path, url if kvpool else None, variant.endswith("same host"), source
    )
    try:
        if not kvpool:  # compute the prompt once: its chunks go to the CPU tier
            e.add("first", prompt)
            e.run("first")
            e.settle()
            assert e.sched.reset_prefix_cache()
        for n in NAMES:
            e.kv[n].zero_()
        e.steps = 0
        t = time.perf_counter()
        e.add("load", prompt)
        nr = e.run("load")
        sec = time.perf_counter() - t
        assert nr.num_computed_tokens == TOKENS, (variant, nr.num_computed_tokens)
        ok = e.matches(nr.block_ids[0][: TOKENS // BLOCK])
        in_kvpool = 0.0
        if kvpool:
            s = e.tier.stats()
            assert s["hits"] == TOKENS // BLOCK and s["errors"] == 0, s
            in_kvpool = s["load_latency"]["sum"]
        return sec, e.steps, in_kvpool, ok
    finally:
        e.close()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpoold", default="target/release/kvpoold")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", default="1GiB", help="kvpoold's --memory")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args()


def quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    for name in ("kvpool", "vllm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def print_table(out: dict) -> None:
    print(
        f"{out['bytes'] >> 20} MiB ({out['tokens']} tokens of Llama-3-8B KV, bf16) through "
        f"vLLM's offloading path, {out['rounds']} rounds; {NUM_BLOCKS}-chunk CPU tier; "
        f"bytes verified: {out['bytes_verified']}"
    )
    hdr = f"{'load':<17} {'min ms':>8} {'median ms':>9} {'max ms':>8} {'GiB/s':>6}  median vs CPU tier"
    print(hdr)
    print("-" * len(hdr))
    for name, r in out["results"].items():
        print(
            f"{name:<17} {r['min_ms']:>8.1f} {r['median_ms']:>9.1f} {r['max_ms']:>8.1f} "
            f"{r['median_gibps']:>6.2f}  {r['median_vs_cpu_tier']:.2f}x "
            f"(steps {r['engine_steps']}; in kvpool loads "
            f"{r['median_ms_in_kvpool_loads']:.1f} ms)"
        )


if __name__ == "__main__":
    main()

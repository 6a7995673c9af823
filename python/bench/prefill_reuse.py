"""Prefill with a cached prefix vs without, on a transformers Llama on the CPU.

The headline of the system we follow: prefill throughput with context caching is 1.42x at 50 %
prefix reuse and 2.28x at 90 % (TTFT -59 % at 90 %). This measures the same with
:class:`kvpool.hf.PrefixCache`: prompts of ``--tokens`` tokens whose first 50 % / 90 % (rounded
down to whole blocks) are a prefix an earlier request saved, served by a kvpoold on this host
(``same_host=True``: one copy out of the mapped pool) and over loopback TCP (``same_host=False``).

Per reuse level and transport it prints the time to first token (lookup + load + compute of the
rest; the save of the new blocks comes after the first token and is shown apart), the speedup
over no cache, and that speedup as a share of the ideal ``1 / (1 - reuse)`` (goal: >= 80 %):
medians over ``--repeats`` interleaved rounds, each in two views. ``CPU``: the model's compute in
this process's CPU seconds (torch on one thread by default, so CPU time is the work done, which
other jobs on a shared machine do not inflate) plus lookup and load in wall time; ``wall``: all
wall time. Where the rest goes: ``lookup``, ``load`` (pool -> registered tensor ->
DynamicCache), and the suffix's compute, which attends over the whole context; ``alone`` is the
same suffix computed with no prefix in front, so ``compute - alone`` is what attention over the
cached prefix costs (the ideal counts it as free).

The default model (2 layers, hidden 2048, 32 heads of 64, 8 KV heads) spends about a fifth of a
4 096-token prefill in attention; a smaller hidden size makes attention a larger share and the
ideal further out of reach (``--layers 4 --hidden 1024``: over a third). ``--shape llama3-8b``
builds layers of Llama-3-8B's shape instead (hidden 4096, MLP 14336, 32 query heads and 8 KV
heads of 128, RoPE theta 500 000; the vocabulary stays 32 000, which only the embedding lookup
and the last token's logits touch): about 0.9 GB of weights per layer, and attention a smaller
share of the prefill, as in the real model.

With ``--disk-dir DIR`` (a directory on a real disk, not tmpfs) the daemon gets a disk tier
there (``--disk-admit all``) and a third cache, ``disk``, on the same-host path: before each of
its prefills the bench writes more filler than the daemon's ``--memory`` holds, so that DRAM
evicts the prefix to disk, waits for the demotion queue to empty and drops the tier's files from
the page cache (``posix_fadvise(DONTNEED)``); the prefill then loads the prefix from the disk (the daemon reads each block up into DRAM, a promotion), checked by the
daemon's ``kvpool_disk_promotions_total`` rising by the prefix's blocks. The DRAM caches run
after it in the same round and find the prefix back in DRAM. Use a small ``--memory`` (the
filler is written, and demoted, once per disk prefill).

Usage: python python/bench/prefill_reuse.py --kvpoold target/release/kvpoold [--tokens 4096]
[--repeats 3] [--layers 2] [--hidden 2048 | --shape llama3-8b] [--threads 1]
[--disk-dir /var/tmp --memory 128MiB] [--out bench-out/prefill-reuse.json]

The model is a random-weight LlamaForCausalLM built from a config (seed 0, fp32, nothing
downloaded). It starts its own kvpoold (free loopback ports, data under /dev/shm), stopped at
the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from _daemons import Kvpoold

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
from kvpool import Client
from kvpool.engine import EngineStore
from kvpool.hf import PrefixCache
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

BLOCK = 16


def build_model(layers: int, hidden: int, shape: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    if shape == "llama3-8b":
        dims = {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
        }
    else:
        dims = {
            "hidden_size": hidden,
            "intermediate_size": hidden * 11 // 4,
            "num_attention_heads": hidden // 64,
            "num_key_value_heads": max(1, hidden // 256),
        }
    cfg = LlamaConfig(
        vocab_size=32000,
        num_hidden_layers=layers,
        max_position_embeddings=8192,
        **dims,
    )
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


@torch.no_grad()
def no_cache(model: LlamaForCausalLM, tokens: list[int]) -> dict[str, float]:
    """Wall and CPU seconds of a plain prefill (the logits of the last token only, as for a
    first token)."""
    t, c = time.perf_counter(), time.process_time()
    model(
        input_ids=torch.tensor([tokens]),
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )
    return {"wall": time.perf_counter() - t, "cpu": time.process_time() - c}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--kvpoold", default=os.environ.get("KVPOOLD", "target/release/kvpoold")
    )
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reuse", default="0.5,0.9")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument(
        "--shape",
        choices=("default", "llama3-8b"),
        default="default",
        help="llama3-8b: layers of Llama-3-8B's shape (--hidden is then ignored)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--memory", default="1GiB")
    ap.add_argument(
        "--disk-dir",
        help="serve the prefix from a disk tier in a directory under this one, too",
    )
    ap.add_argument("--disk-capacity", default="4GiB")
    ap.add_argument("--out", default="bench-out/prefill-reuse.json")
    a = ap.parse_args()

    tier = disk_tier_dir(a.disk_dir) if a.disk_dir else None
    extra = []
    if tier:
        extra = ["--disk-path", tier, "--disk-capacity", a.disk_capacity]
        extra += ["--disk-admit", "all", "--disk-queue", "1GiB"]
    daemon = Kvpoold(a.kvpoold, a.memory, extra)
    try:
        flush = DiskFlush(daemon, a.memory, tier) if tier else None
        result = run(a, f"tcp://{daemon.tcp}", flush)
    finally:
        daemon.stop()
        if tier:
            shutil.rmtree(tier, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {a.out}")


def disk_tier_dir(base: str) -> str:
    """A fresh directory under ``base``, which must be on a real disk."""
    kind = subprocess.run(
        ["stat", "-f", "-c", "%T", base], capture_output=True, text=True, check=True
    ).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        sys.exit(f"--disk-dir {base} is on {kind}: the disk tier needs a real disk")
    return tempfile.mkdtemp(prefix="kvpool-prefill-disk-", dir=base)


def parse_size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(s[: -len(u)]) * m
    return int(s)


class DiskFlush:
    """Pushes everything in the daemon's DRAM out to its disk tier in ``tier`` (filler of more
    than its memory, through a client of its own), drops the tier's files from the page cache,
    and counts the blocks read back up from disk."""

    FILLER = 4 << 20

    def __init__(self, daemon: Kvpoold, memory: str, tier: str):
        self.tier = tier
        self.metrics = daemon.addrs["metrics"]
        self.client = Client(f"tcp://{daemon.tcp}", same_host=True, timeout=60.0)
        self.count = parse_size(memory) * 5 // 4 // self.FILLER + 1
        self.rounds = 0
        self.promoted: list[int] = []

    def counter(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith((name + "{", name + " ")):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def push_out(self) -> None:
        """Fills DRAM with new filler, then waits until every demotion reached the disk."""
        self.rounds += 1
        value = bytes(self.FILLER)
        keys = [f"filler/{self.rounds}/{i}".encode() for i in range(self.count)]
        for k in keys:
            self.client.write(k, value)
        deadline = time.monotonic() + 120
        while self.counter("kvpool_disk_queued_bytes") > 0:
            if time.monotonic() > deadline:
                sys.exit("the demotion queue did not empty within 120 s")
            time.sleep(0.05)
        if self.counter("kvpool_disk_queue_drops_total") > 0:
            sys.exit("the demotion queue dropped writes: the prefix may not be on disk")
        # So that the prefix is read from the device, not from pages its writes left cached.
        for name in os.listdir(self.tier):
            fd = os.open(os.path.join(self.tier, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.before = self.counter("kvpool_disk_promotions_total")

    def check(self, blocks: int) -> None:
        """After a disk prefill: at least the prefix's ``blocks`` came up from disk."""
        n = int(self.counter("kvpool_disk_promotions_total") - self.before)
        if n < blocks:
            sys.exit(f"disk: {n} blocks read up from disk, not the prefix's {blocks}")
        self.promoted.append(n)


def run(a: argparse.Namespace, url: str, flush: DiskFlush | None) -> dict:
    torch.set_num_threads(a.threads)
    model = build_model(a.layers, a.hidden, a.shape)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)

    def fresh(n: int) -> list[int]:
        return torch.randint(0, 32000, (n,), generator=gen).tolist()

    caches = open_caches(url, model, flush is not None)
    kv_per_token = caches["tcp"].block_bytes // BLOCK
    print(
        f"model: {a.layers} layers ({a.shape} shape), hidden {model.config.hidden_size}, "
        f"{params / 1e6:.0f} M parameters, "
        f"fp32, {kv_per_token // 1024} KiB of KV per token; prompts of {a.tokens} tokens; "
        f"torch {torch.__version__} on {torch.get_num_threads()} threads; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    no_cache(model, fresh(256))  # warm up the kernels
    levels = seed_prefixes(a, caches, fresh)
    base = measure_rounds(a, model, caches, levels, fresh, flush)
    base_wall, base_cpu = med([b["wall"] for b in base]), med([b["cpu"] for b in base])
    print(
        f"no cache: {base_wall:.3f} s wall, {base_cpu:.3f} s CPU "
        f"({a.tokens / base_wall:.0f} tokens/s); load average after: "
        f"{os.getloadavg()[0]:.2f}"
    )

    rows = []
    for prefix_len, _, alone, by_transport in levels:
        for transport, runs in by_transport.items():
            rows.append(
                level_row(
                    a.tokens,
                    prefix_len,
                    transport,
                    runs,
                    alone,
                    (base_wall, base_cpu),
                    kv_per_token,
                )
            )
    print_table(rows)
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": {
            "layers": a.layers,
            "shape": a.shape,
            "hidden": model.config.hidden_size,
            "intermediate": model.config.intermediate_size,
            "kv_heads": model.config.num_key_value_heads,
            "parameters": params,
        },
        "kv_bytes_per_token": kv_per_token,
        "no_cache_runs": base,
        "rows": rows,
        "disk_promotions_per_prefill": flush.promoted if flush else None,
    }


def open_caches(
    url: str, model: LlamaForCausalLM, disk: bool
) -> dict[str, PrefixCache]:
    """A prefix cache of ``model`` per transport, each on its own EngineStore: same host,
    and TCP with the same-host path off; with ``disk``, first a same-host one whose prefix is
    pushed out to disk before each of its prefills."""
    caches = {}
    transports = [("same-host", True), ("tcp", False)]
    if disk:
        transports.insert(0, ("disk", True))
    for transport, same_host in transports:
        st = EngineStore(url, lookup_timeout=1.0, io_timeout=30.0, same_host=same_host)
        if st.is_local != same_host:
            sys.exit(f"{transport}: is_local is {st.is_local}")
        caches[transport] = PrefixCache(
            st, model, BLOCK, model_id="prefill-reuse-bench"
        )
    return caches


def seed_prefixes(
    a: argparse.Namespace, caches: dict[str, PrefixCache], fresh: Callable
) -> list[tuple]:
    """A prefix per reuse level, left in the pool by one request; returns per level the
    prefix's length, its tokens and empty lists for the suffix alone and each transport's
    runs."""
    levels = []
    for reuse in (float(r) for r in a.reuse.split(",")):
        prefix_len = int(a.tokens * reuse) // BLOCK * BLOCK
        prefix = fresh(prefix_len)
        # The request that leaves the prefix in the pool.
        seed = caches["same-host"].prefill(prefix, logits_to_keep=1)
        assert seed.blocks_saved == prefix_len // BLOCK, seed.blocks_saved
        levels.append((prefix_len, prefix, [], {t: [] for t in caches}))
    return levels


def measure_rounds(
    a: argparse.Namespace,
    model: LlamaForCausalLM,
    caches: dict[str, PrefixCache],
    levels: list[tuple],
    fresh: Callable,
    flush: DiskFlush | None,
) -> list[dict[str, float]]:
    """``--repeats`` rounds, each of a prefill without cache, then per level the suffix
    alone and a prefill through each transport's cache (into the level's lists); returns
    the prefills without cache. The disk cache's prefill follows a push of DRAM to disk."""
    # Rounds interleave every configuration, so that the other load on a shared machine falls
    # on all of them alike; each figure is the median over the rounds.
    base: list[dict[str, float]] = []
    for _ in range(a.repeats):
        base.append(no_cache(model, fresh(a.tokens)))
        for prefix_len, prefix, alone, runs in levels:
            alone.append(no_cache(model, fresh(a.tokens - prefix_len)))
            for transport, pc in caches.items():
                if transport == "disk" and flush:
                    flush.push_out()
                r = pc.prefill(prefix + fresh(a.tokens - prefix_len), logits_to_keep=1)
                if r.tokens_loaded != prefix_len:
                    sys.exit(f"{transport}: loaded {r.tokens_loaded}, not {prefix_len}")
                if transport == "disk" and flush:
                    flush.check(prefix_len // BLOCK)
                runs[transport].append((r.seconds, r.cpu_seconds))
    return base


def level_row(
    tokens: int,
    prefix_len: int,
    transport: str,
    runs: list,
    alone: list,
    no_cache_s: tuple[float, float],
    kv_per_token: int,
) -> dict:
    """One reuse level's figures through one transport, against the prefill without cache
    (``no_cache_s``: its median wall and CPU seconds)."""
    base_wall, base_cpu = no_cache_s
    wall = {k: med([w[k] for w, _ in runs]) for k in runs[0][0]}
    cpu = {k: med([c[k] for _, c in runs]) for k in runs[0][1]}
    ttft_walls = [w["lookup"] + w["load"] + w["compute"] for w, _ in runs]
    # The CPU-time view: the model's work in CPU seconds, lookup and load in wall
    # time (their waits on kvpoold are not this process's CPU time).
    ttft_cpus = [w["lookup"] + w["load"] + c["compute"] for w, c in runs]
    ttft_wall, ttft_cpu = med(ttft_walls), med(ttft_cpus)
    ideal = 1 / (1 - prefix_len / tokens)
    return {
        "reuse": prefix_len / tokens,
        "transport": transport,
        "tokens": tokens,
        "cached_tokens": prefix_len,
        "ideal": ideal,
        "no_cache_wall_s": base_wall,
        "ttft_wall_s": ttft_wall,
        "speedup_wall": base_wall / ttft_wall,
        "share_of_ideal_wall": base_wall / ttft_wall / ideal,
        "no_cache_cpu_s": base_cpu,
        "ttft_cpu_s": ttft_cpu,
        "speedup_cpu": base_cpu / ttft_cpu,
        "share_of_ideal_cpu": base_cpu / ttft_cpu / ideal,
        "ttft_reduction_cpu": 1 - ttft_cpu / base_cpu,
        "throughput_tokens_per_cpu_s": tokens / ttft_cpu,
        "lookup_s": wall["lookup"],
        "load_s": wall["load"],
        "load_gbps": prefix_len * kv_per_token / wall["load"] / 1e9,
        "compute_cpu_s": cpu["compute"],
        "compute_wall_s": wall["compute"],
        "suffix_alone_cpu_s": med([x["cpu"] for x in alone]),
        "suffix_alone_wall_s": med([x["wall"] for x in alone]),
        "save_s": wall["save"],
        "ttft_wall_runs_s": ttft_walls,
        "ttft_cpu_runs_s": ttft_cpus,
    }


def print_table(rows: list[dict]) -> None:
    print(
        "\nreuse  transport   ideal | CPU: no-cache s  TTFT s  speedup  share  TTFT- "
        "| wall: no-cache s  TTFT s  speedup  share"
    )
    for r in rows:
        print(
            f"{r['reuse']:4.0%}   {r['transport']:<10} {r['ideal']:5.1f}x |"
            f"{r['no_cache_cpu_s']:15.3f}  {r['ttft_cpu_s']:6.3f}  "
            f"{r['speedup_cpu']:6.2f}x  {r['share_of_ideal_cpu']:4.0%}  "
            f"{r['ttft_reduction_cpu']:4.0%} |{r['no_cache_wall_s']:16.3f}  "
            f"{r['ttft_wall_s']:6.3f}  {r['speedup_wall']:6.2f}x  "
            f"{r['share_of_ideal_wall']:4.0%}"
        )
    print(
        "\nreuse  transport   lookup ms  load ms  load GB/s  compute CPU s  "
        "same suffix alone CPU s  attention over the prefix s  save ms"
    )
    for r in rows:
        print(
            f"{r['reuse']:4.0%}   {r['transport']:<10} {r['lookup_s'] * 1e3:9.2f}  "
            f"{r['load_s'] * 1e3:7.1f}  {r['load_gbps']:9.2f}  {r['compute_cpu_s']:13.3f}  "
            f"{r['suffix_alone_cpu_s']:23.3f}  "
            f"{r['compute_cpu_s'] - r['suffix_alone_cpu_s']:27.3f}  {r['save_s'] * 1e3:7.1f}"
        )


if __name__ == "__main__":
    main()

"""Loads 4096 tokens of Llama-3-8B-shaped KV (512 MiB bf16) through each engine connector, on
the same host and over loopback TCP, next to a memcpy and a raw TCP stream of the same bytes.

Usage: python connector_load.py --kvpoold target/release/kvpoold [--rounds 5] [--pieces]
[--out bench-out/connector-load.json]

One run, one kvpoold of its own (data directory under /dev/shm, loopback ports, stopped at the
end). The KV is stored once per connector, then loaded through each connector's real load
path, as its engine calls it, into that engine's real host memory:

* SGLang: ``KvpoolStore.batch_get_v1`` into a real ``MHATokenToKVPoolHost`` (page_first, 64-token
  pages, SGLang's batches of ``STORAGE_BATCH_SIZE`` = 128 pages);
* vLLM: the worker-role ``KvpoolConnector`` (synchronous load: ``bind_connector_metadata``,
  ``start_load_kv``, which waits for the loader thread) into per-layer KV tensors allocated by
  vLLM's ``allocate_kv_cache`` (16-token blocks, the connector's default 16-block batches;
  on the same host each block's object straight into its 32 layers' pages, over TCP through
  the 64-slot staging buffer);
* LMCache: ``RemoteBackend.batched_get_blocking`` (LMCache's real ``RemoteBackend``, whose
  connector is ``KvpoolRemoteConnector``) into ``MemoryObj``\\ s of 256-token chunks allocated
  from its real ``LocalCPUBackend``.

Each connector twice: same host (the default) and over loopback TCP (vLLM's and LMCache's
``same_host: false``, SGLang's ``kvpool_same_host: false``). Every round measures, in this
order, a single-thread memcpy of 512 MiB (``ctypes.memmove`` between two preallocated,
pre-touched buffers; also, as context, the same bytes in 4 MiB memmoves), a raw TCP stream of 512 MiB over loopback (a server subprocess
``sendall``-ing one preallocated buffer in reply to an 8-byte request; the client
``recv_into`` a preallocated buffer), then the six connector loads. Best and median over the
rounds; ratios of the medians (and of the bests). Loaded bytes are compared with the stored
ones at the end. ``--pieces`` times parts of each load apart (after the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

from _daemons import Kvpoold

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from _load_baselines import Memcpy, RawTcp, verify_models
from _load_common import TOKENS, best_of, summary
from _load_lmcache import LMCache
from _load_sglang import SGLang
from _load_vllm import VLLM

MODES = ("same host", "TCP")


def main() -> None:
    a = parse_args()
    logging_quiet()
    tmp = tempfile.mkdtemp(prefix="kvpool-load-")
    daemon = Kvpoold(a.kvpoold, a.memory, prefix="kvpool-load-")
    loads = Loads()
    try:
        loads.start(daemon.tcp, tmp)
        times, load_avg = measure_rounds(loads.runs(), a.rounds)
        checks = loads.check()
        pieces = loads.pieces() if a.pieces else {}
    finally:
        loads.close()
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    out = {
        "bytes": loads.nbytes,
        "tokens": TOKENS,
        "rounds": a.rounds,
        "load_average_1m": [round(x, 2) for x in load_avg],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bytes_verified": checks,
        "results": results(times, loads.nbytes, a.goal),
    }
    if pieces:
        out["pieces"] = pieces
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
    ap.add_argument("--pieces", action="store_true", help="time parts of each load")
    ap.add_argument("--goal", type=float, default=0.8)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args()


class Loads:
    """The three connectors with the KV stored through each, and the memcpy and raw TCP
    stream of the same bytes; :meth:`close` stops whatever was made."""

    def __init__(self) -> None:
        self.made: list = []
        self.raw_tcp: RawTcp | None = None
        self.nbytes = 0

    def start(self, tcp: str, tmp: str) -> None:
        """Builds each connector on the kvpoold at ``tcp`` and stores the KV through it, then
        the baselines of as many bytes."""
        t0 = time.perf_counter()
        self.sgl = SGLang(tcp)
        self.made.append(self.sgl)
        self.vl = VLLM(tcp, tmp)
        self.made.append(self.vl)
        self.lmc = LMCache(tcp, tmp)
        self.made.append(self.lmc)
        for c in self.made:
            c.save()
        sgl, vl, lmc = self.sgl, self.vl, self.lmc
        nbytes = sgl.nbytes
        assert vl.nbytes == nbytes and lmc.nbytes == nbytes, (
            sgl.nbytes,
            vl.nbytes,
            lmc.nbytes,
        )
        self.nbytes = nbytes
        self.memcpy = Memcpy(nbytes)
        self.raw_tcp = RawTcp(nbytes)
        print(
            f"set up and stored 3 x {nbytes >> 20} MiB in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )

    def connectors(self) -> tuple:
        return (("SGLang", self.sgl), ("vLLM", self.vl), ("LMCache", self.lmc))

    def runs(self) -> dict[str, Callable[[], None]]:
        """Every measured load by name, in the order of a round: the baselines, then each
        connector on the same host and over TCP."""
        assert self.raw_tcp is not None
        runs = {
            "memcpy": self.memcpy.run,
            "memcpy 4 MiB pieces": self.memcpy.run_pieces,
            "raw TCP": self.raw_tcp.run,
        }
        for name, c in self.connectors():
            for mode in MODES:
                runs[f"{name} {mode}"] = lambda c=c, m=mode: c.load(m)
        return runs

    def check(self) -> dict[str, bool]:
        """Whether each connector's loaded bytes are the stored ones."""
        return {
            "SGLang": self.sgl.check(),
            "vLLM": self.vl.check(),
            "LMCache": self.lmc.check(),
        }

    def pieces(self) -> dict:
        """Parts of each load timed apart, and the models of the client's own work."""
        assert self.raw_tcp is not None
        pieces = {}
        for name, c in self.connectors():
            for mode in MODES:
                pieces[f"{name} {mode}"] = c.pieces(mode)
        pieces["client verify model"] = verify_models(self.nbytes, self.memcpy)
        if "skipped" not in pieces["client verify model"]:
            pieces["client verify model"]["raw_tcp_ms"] = (
                best_of(self.raw_tcp.run, 3) * 1e3
            )
            pieces["client verify model"]["raw_tcp_64KiB_reads_xxh3_ms"] = (
                best_of(self.raw_tcp.run_hashed, 3) * 1e3
            )
        return pieces

    def close(self) -> None:
        for c in reversed(self.made):
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 (keep closing the rest)
                print(f"closing {type(c).__name__}: {e!r}", file=sys.stderr)
        if self.raw_tcp is not None:
            self.raw_tcp.close()


def measure_rounds(
    runs: dict[str, Callable[[], None]], rounds: int
) -> tuple[dict[str, list[float]], list[float]]:
    """One unrecorded pass of every load, then ``rounds`` timed rounds of all of them in
    order; returns each load's times and the 1-minute load average before and after each
    round."""
    for fn in runs.values():  # warm up: first touches, connections, threads
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


def results(times: dict[str, list[float]], nbytes: int, goal: float) -> dict:
    """Each load's summary, the connectors' with their ratios to their baseline (memcpy on
    the same host, raw TCP over TCP) and whether they meet ``goal``."""
    res = {k: summary(v, nbytes) for k, v in times.items()}
    for name, r in res.items():
        if name in ("memcpy", "memcpy 4 MiB pieces", "raw TCP"):
            continue
        if name.endswith("same host"):
            pieces_gibps = res["memcpy 4 MiB pieces"]["median_gibps"]
            r["ratio_median_vs_memcpy_pieces"] = r["median_gibps"] / pieces_gibps
        base = res["memcpy" if name.endswith("same host") else "raw TCP"]
        r["baseline"] = "memcpy" if name.endswith("same host") else "raw TCP"
        r["ratio_median"] = r["median_gibps"] / base["median_gibps"]
        r["ratio_best"] = r["best_gibps"] / base["best_gibps"]
        r["goal"] = goal
        r["met"] = r["ratio_median"] >= goal
    return res


def logging_quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    for name in ("kvpool", "lmcache", "vllm", "sglang"):
        logging.getLogger(name).setLevel(logging.WARNING)


def print_table(out: dict) -> None:
    la = out["load_average_1m"]
    print(
        f"{out['bytes'] >> 20} MiB ({out['tokens']} tokens of Llama-3-8B KV, bf16), "
        f"{out['rounds']} rounds; load average {min(la):.2f}-{max(la):.2f}; "
        f"bytes verified: {out['bytes_verified']}"
    )
    hdr = f"{'load':<19} {'best GiB/s':>10} {'median GiB/s':>12} {'median ms':>9}  ratio (median; best)"
    print(hdr)
    print("-" * len(hdr))
    for name, r in out["results"].items():
        line = (
            f"{name:<19} {r['best_gibps']:>10.2f} {r['median_gibps']:>12.2f} "
            f"{r['median_ms']:>9.1f}"
        )
        if "ratio_median" in r:
            verdict = "met" if r["met"] else "MISSED"
            line += (
                f"  {r['ratio_median']:.2f}x {r['baseline']} ({r['ratio_best']:.2f}x); "
                f"goal >= {r['goal']}x: {verdict}"
            )
        if "ratio_median_vs_memcpy_pieces" in r:
            line += f"; {r['ratio_median_vs_memcpy_pieces']:.2f}x 4 MiB pieces"
        print(line)
    for name, p in out.get("pieces", {}).items():
        print(
            f"pieces {name}: "
            + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in p.items()
            )
        )


if __name__ == "__main__":
    main()

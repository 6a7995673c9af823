#!/usr/bin/env python3
"""The model-weight figures that live in the Python package, measured from Python
(docs/BENCHMARKS.md, "Model weights").

1. ``kvpool.weights.weight_iterator``: the time from the call to the first ``(name, array)``
   (goal: 5 ms) and to the last, against reading the same safetensors file
   (``safetensors.torch.load_file``, and the file read into one numpy buffer with a view per
   tensor, which is what ``safetensors.numpy.load_file`` does for the dtypes numpy has) and
   against ``kvpool.weights.load_into`` into preallocated buffers. The first tensor's time is
   broken down (manifest fetch, manifest parse, a small tensor's round trip, the first tensor's
   buffer allocation and load).
2. ``kvpool.weights.ensure`` single flight: 4 processes (multiprocessing, spawn) calling
   ``ensure(client, name, path)`` behind a start barrier on a model not yet in the pool, against
   one process alone on a fresh pool (goal: 4 processes within 1.2x one, with exactly one
   ``how="published"``, i.e. one read of the file); then the same with the model already
   published (4 warm loads at once against one).

The checkpoint is generated as ``kvpool-bench weights`` generates it (a Llama-style bf16
decoder, tensors in name order, pseudo-random bytes), in a temporary directory removed at the
end. Each measurement is repeated ``--reps`` times, contender and reference alternating, and
every loaded byte is compared with the file's. The script starts its own kvpoold on a data
directory under /dev/shm (a fresh one for each cold ``ensure``) and stops it at the end.

    cargo build --release -p kvpool-server
    target/pyenv/bin/python benches/scripts/weights_bench.py [--size 64MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _weights_checkpoint import Shape, parse_size, write_checkpoint
from _weights_daemon import Daemon, find_kvpoold
from _weights_ensure import bench_ensure
from _weights_iterator import bench_iterator
from _weights_report import Deadline, Row, render
from _weights_views import bench_views


def main() -> int:
    args = parse_args()
    binary = find_kvpoold(args.kvpoold)
    deadline = Deadline(args.timeout)
    began = time.monotonic()
    shape = Shape.for_size(args.size)
    memory = shape.bytes() * 5 // 4 + (256 << 20)
    machine = {
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "kvpoold": str(binary),
    }
    print(f"weights_bench: {shape.describe()}; {machine}", file=sys.stderr)
    rows = measure(args, binary, shape, memory, deadline)
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    took = time.monotonic() - began
    print(render(rows))
    print(
        f"({took:.1f} s; {machine['cpus']} CPUs, load average {machine['load_average']} before, {machine['load_average_after']} after)"
    )
    if args.json:
        write_json(args, shape, took, machine, rows)
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("2GiB"),
        help="checkpoint size (default 2GiB; at least 32MiB)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=3,
        help="repetitions of each figure (medians compared)",
    )
    ap.add_argument(
        "--latency-reps",
        type=int,
        default=10,
        help="repetitions of the first-tensor breakdown",
    )
    ap.add_argument(
        "--procs", type=int, default=4, help="processes calling ensure at once"
    )
    ap.add_argument(
        "--kvpoold",
        help="kvpoold binary (default target/release/kvpoold, else $KVPOOLD)",
    )
    ap.add_argument(
        "--dir",
        help="where the checkpoint is written (default the system's temp directory)",
    )
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument(
        "--timeout", type=float, default=1200, help="give up after this many seconds"
    )
    args = ap.parse_args()
    if args.reps < 1 or args.latency_reps < 1 or args.procs < 2:
        ap.error("--reps and --latency-reps must be positive, --procs at least 2")
    return args


def measure(
    args: argparse.Namespace,
    binary: Path,
    shape: Shape,
    memory: int,
    deadline: Deadline,
) -> list[Row]:
    """Writes the checkpoint into a temporary directory (removed at the end), then measures
    weight_iterator and load on one kvpoold, then ensure on kvpoolds of their own."""
    work = Path(tempfile.mkdtemp(prefix="kvpool-wbench-", dir=args.dir))
    rows: list[Row] = []
    try:
        ck = write_checkpoint(shape, work / "model.safetensors")
        # The page cache warm, as for the Rust bench's reference read.
        with open(ck.path, "rb") as f:
            while f.read(16 << 20):
                pass
        import kvpool

        d = Daemon(binary, memory, "iter")
        try:
            kv = kvpool.Client(d.url)
            bench_iterator(kv, ck, args.reps, args.latency_reps, rows)
            deadline.check("the load measurements")
            bench_views(kv, ck, args.reps, rows)
        finally:
            d.stop()
        deadline.check("the ensure measurements")
        bench_ensure(binary, memory, ck, args.reps, args.procs, deadline, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def write_json(
    args: argparse.Namespace,
    shape: Shape,
    took: float,
    machine: dict[str, Any],
    rows: list[Row],
) -> None:
    with open(args.json, "w") as f:
        json.dump(
            {
                "bench": "weights_bench.py",
                "model": shape.describe(),
                "bytes": shape.bytes(),
                "reps": args.reps,
                "procs": args.procs,
                "seconds": round(took, 1),
                "machine": machine,
                "rows": [r.to_json() for r in rows],
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    sys.exit(main())

"""``weights_bench.py``'s single-flight figure: ``kvpool.weights.ensure`` called by several
processes at once (multiprocessing, spawn, behind a start barrier) against one process alone,
on a model not yet in the pool and on one already published, next to what each process does
without the pool."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _weights_checkpoint import NAME, Checkpoint, read_file
from _weights_daemon import Daemon
from _weights_report import Deadline, Row, alternate, fmt_s

ENSURE_GOAL = 1.2


def ensure_worker(
    mode: str,
    url: str,
    name: str,
    path: str,
    lock_dir: str,
    spans: dict[str, tuple[int, int]],
    order: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """One process of the single-flight measurement: connects, waits on the barrier, runs
    ``ensure`` (mode ``ensure``), reads the file (``read``: what each process does without the
    pool) or only allocates and writes memory of the tensors' sizes (``touch``: the cost of a
    private copy's fresh pages), then checks every array against the file and reports."""
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        import kvpool
        import kvpool.weights as kw

        kv = kvpool.Client(url)
        barrier.wait(120)
        t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
        if mode == "ensure":
            e = kw.ensure(kv, name, path, lock_directory=lock_dir)
            arrays: dict[str, Any] = e.arrays or {}
            out.update(how=e.how, report=e.report)
        elif mode == "read":
            arrays = read_file(path)
        else:
            arrays = {n: np.ones(spans[n][1], dtype=np.uint8) for n in order}
        t1 = time.clock_gettime(time.CLOCK_MONOTONIC)
        out.update(start=t0, end=t1)
        ck = Checkpoint(Path(path), [])
        out["verified"] = mode == "touch" or (
            list(arrays) == order
            and all(ck.same(n, a, spans) for n, a in arrays.items())
        )
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which fails the run)
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)


def run_ensure(
    url: str,
    ck: Checkpoint,
    name: str,
    n: int,
    lock_dir: Path,
    deadline: Deadline,
    mode: str = "ensure",
) -> dict[str, Any]:
    """``n`` processes calling ensure (or ``mode``) at once; returns the wall time (first
    start to last end), each process's ``how`` and duration."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    spans = ck.spans()
    order = [t[0] for t in ck.tensors]
    procs = [
        ctx.Process(
            target=ensure_worker,
            args=(
                mode,
                url,
                name,
                str(ck.path),
                str(lock_dir),
                spans,
                order,
                barrier,
                results,
            ),
        )
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    outs = []
    try:
        for _ in procs:
            outs.append(results.get(timeout=max(1.0, deadline.left())))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"{mode} worker failed: {errors}")
    if not all(o["verified"] for o in outs):
        raise RuntimeError(f"a {mode} process's arrays differ from the file")
    return {
        "wall": max(o["end"] for o in outs) - min(o["start"] for o in outs),
        "how": sorted(o.get("how", mode) for o in outs),
        "each": sorted(o["end"] - o["start"] for o in outs),
    }


def bench_ensure(
    binary: Path,
    memory: int,
    ck: Checkpoint,
    reps: int,
    procs: int,
    deadline: Deadline,
    rows: list[Row],
) -> dict[str, Any]:
    runs = measure_ensure(binary, memory, ck, reps, procs, deadline)
    ensure_rows(ck, procs, runs, rows)
    return runs


def measure_ensure(
    binary: Path,
    memory: int,
    ck: Checkpoint,
    reps: int,
    procs: int,
    deadline: Deadline,
) -> dict[str, list[dict[str, Any]]]:
    """1 and ``procs`` processes at once: ``ensure`` on a fresh kvpoold each (cold), then on
    one where the model is published, alternating with reading the file and touching as many
    bytes; the runs of each, by ``{mode}{processes}``."""
    import kvpool
    import kvpool.weights as kw

    lock_dir = Path(tempfile.mkdtemp(prefix="kvpool-wbench-locks-"))
    runs: dict[str, list[dict[str, Any]]] = {}
    seq = [0]

    def cold(n: int) -> Callable[[], None]:
        def go() -> None:
            deadline.check(f"cold ensure x{n}")
            d = Daemon(binary, memory, "cold")
            try:
                seq[0] += 1
                runs.setdefault(f"cold{n}", []).append(
                    run_ensure(d.url, ck, f"{NAME}-{seq[0]}", n, lock_dir, deadline)
                )
            finally:
                d.stop()

        return go

    d = Daemon(binary, memory, "warm")

    def warm(n: int, mode: str = "ensure") -> Callable[[], None]:
        def go() -> None:
            deadline.check(f"warm {mode} x{n}")
            runs.setdefault(f"{mode}{n}", []).append(
                run_ensure(d.url, ck, NAME, n, lock_dir, deadline, mode)
            )

        return go

    try:
        alternate(reps, [cold(1), cold(procs)])
        kw.publish(kvpool.Client(d.url), NAME, ck.path)
        # The warm loads alternate with what each process does without the pool (reading the
        # file) and with the cost of a private copy's fresh pages alone (touch).
        alternate(
            reps,
            [warm(1), warm(procs), warm(1, "read"), warm(procs, "read")]
            + [warm(1, "touch"), warm(procs, "touch")],
        )
    finally:
        d.stop()
        shutil.rmtree(lock_dir, ignore_errors=True)
    return runs


def ensure_rows(
    ck: Checkpoint, procs: int, runs: dict[str, list[dict[str, Any]]], rows: list[Row]
) -> None:
    """The rows of the measured ``runs``: each of ``procs`` processes at once against one, for
    the cold and the warm ensure and both references; raises unless the cold runs published
    exactly once each and the warm ones loaded from the pool."""
    phase = f"ensure: {procs} processes at once (spawn, start barrier) against 1"

    def pair(one_key: str, many_key: str, label: str) -> tuple[Row, Row]:
        one = Row(
            phase, f"1 process, {label}", ck.nbytes, [r["wall"] for r in runs[one_key]]
        )
        many = Row(
            phase,
            f"{procs} processes, {label}",
            procs * ck.nbytes,
            [r["wall"] for r in runs[many_key]],
        )
        many.versus, many.ratio = "1 process (time)", many.median / one.median
        each = runs[many_key]
        many.note = (
            f"processes took {fmt_s(statistics.median(r['each'][0] for r in each))} "
            f"to {fmt_s(statistics.median(r['each'][-1] for r in each))}"
        )
        return one, many

    one, many = pair("cold1", f"cold{procs}", "ensure, model not in the pool")
    hows = [r["how"] for r in runs[f"cold{procs}"]]
    single = all(
        h.count("published") == 1 and h.count("pool") == procs - 1 for h in hows
    )
    many.goal = "≤ 1.2×, one publish"
    many.met = many.ratio <= ENSURE_GOAL and single
    counts = "; ".join(
        f"{h.count('published')} published, {h.count('pool')} pool" for h in hows
    )
    many.note = f"per run: {counts}; {many.note}"
    many.data["how_per_run"] = hows
    if not all(r["how"] == ["published"] for r in runs["cold1"]):
        raise RuntimeError("a lone ensure on a fresh pool did not publish")
    rows += [one, many]
    one, many = pair("ensure1", f"ensure{procs}", "ensure, model already published")
    if not all(set(r["how"]) == {"pool"} for r in runs[f"ensure{procs}"]):
        raise RuntimeError("a warm ensure did not load from the pool")
    rows += [one, many]
    rows += pair("read1", f"read{procs}", "reference: file read into numpy (no pool)")
    rows += pair(
        "touch1", f"touch{procs}", "reference: allocate + write the bytes (np.ones)"
    )

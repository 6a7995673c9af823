"""The transfers of the vLLM offloading tier: a saver and a loader thread that move chunk rows
between the CPU tier's registered memory and kvpool, and the results vLLM collects."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobId, JobResult

from .engine import EngineStore

log = logging.getLogger("kvpool.vllm_offload")

# One transfer: (job id, vLLM keys, row pointers, row bytes).
_Job = tuple[JobId, list[OffloadKey], list[int], int]


class ChunkIo:
    """Runs stores and promotions off vLLM's scheduler thread, ``batch`` chunks per kvpool call
    (each call bounded by the store's ``io_timeout``). Promotions have their own thread, so a
    request waiting for its prefix never queues behind write-through traffic."""

    def __init__(
        self, store: EngineStore, key: Callable[[OffloadKey], str], batch: int
    ) -> None:
        self._store = store
        self._key = key
        self._batch = batch
        self._results: list[JobResult] = []
        self._pending = 0  # jobs submitted whose result is not yet in _results
        self._cv = threading.Condition()
        self._queues: dict[str, queue.SimpleQueue[_Job | None]] = {
            "saver": queue.SimpleQueue(),
            "loader": queue.SimpleQueue(),
        }
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(q, self._save if name == "saver" else self._load),
                name=f"kvpool-vllm-offload-{name}",
                daemon=True,
            )
            for name, q in self._queues.items()
        ]
        for th in self._threads:
            th.start()

    # ----- scheduler thread -----

    def store(
        self, job_id: JobId, keys: list[OffloadKey], ptrs: list[int], size: int
    ) -> None:
        self._submit("saver", (job_id, keys, ptrs, size))

    def load(
        self, job_id: JobId, keys: list[OffloadKey], ptrs: list[int], size: int
    ) -> None:
        self._submit("loader", (job_id, keys, ptrs, size))

    def done(self, result: JobResult) -> None:
        """Reports a job that finished without a transfer."""
        with self._cv:
            self._results.append(result)

    def finished(self) -> list[JobResult]:
        with self._cv:
            out, self._results = self._results, []
        return out

    def busy(self) -> bool:
        """Whether a transfer is running or a result is waiting to be collected."""
        with self._cv:
            return self._pending > 0 or bool(self._results)

    def drain(self) -> None:
        """Waits until every submitted transfer has finished (each ends within its calls'
        deadlines); their results stay for the next ``finished``."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    def shutdown(self) -> None:
        self.drain()
        for q in self._queues.values():
            q.put(None)
        for th in self._threads:
            th.join()

    # ----- transfer threads -----

    def _submit(self, which: str, job: _Job) -> None:
        with self._cv:
            self._pending += 1
        self._queues[which].put(job)

    def _run(
        self, q: queue.SimpleQueue[_Job | None], move: Callable[..., JobResult]
    ) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                result = move(*job)
            except Exception as e:  # noqa: BLE001 (a failed transfer is a failed job)
                log.warning("kvpool tier: job %d failed: %r", job[0], e)
                result = JobResult(job[0], False)
            result.transfer_time = time.perf_counter() - start
            with self._cv:
                self._results.append(result)
                self._pending -= 1
                self._cv.notify_all()

    def _batches(self, n: int) -> range:
        return range(0, n, self._batch)

    def _save(
        self, job_id: JobId, keys: list[OffloadKey], ptrs: list[int], size: int
    ) -> JobResult:
        """Stores the rows kvpool lacks (one presence call, then one put, per batch)."""
        sent = 0
        ok = True
        for i in self._batches(len(keys)):
            names = [self._key(k) for k in keys[i : i + self._batch]]
            rows = ptrs[i : i + self._batch]
            have = self._store.presence(names)
            todo = [(n, p) for n, p, h in zip(names, rows, have) if not h]
            if not todo:
                continue
            stored = self._store.save(
                [n for n, _ in todo], [p for _, p in todo], [size] * len(todo)
            )
            sent += size * sum(stored)
            ok = ok and all(stored)
        return JobResult(job_id, ok, transfer_bytes=sent)

    def _load(
        self, job_id: JobId, keys: list[OffloadKey], ptrs: list[int], size: int
    ) -> JobResult:
        """Loads every row straight into its CPU-tier slot (one call per batch)."""
        loaded: list[OffloadKey] = []
        for i in self._batches(len(keys)):
            part = keys[i : i + self._batch]
            got = self._store.load(
                [self._key(k) for k in part],
                ptrs[i : i + self._batch],
                [size] * len(part),
            )
            loaded += [k for k, g in zip(part, got) if g]
        ok = len(loaded) == len(keys)
        partial: Any = None if ok or not loaded else tuple(loaded)
        return JobResult(
            job_id, ok, successful_keys=partial, transfer_bytes=size * len(loaded)
        )

"""Moving an engine's KV pages between its registered host memory and kvpool.

A page of an engine's host cache is stored as one or more objects (K and V, or one latent, or a
sidecar's state). Each object lives in host memory as one contiguous range, or as several
segments (one per layer, in a layer-first pool). :class:`PageIO` loads and stores a batch of
such objects through :class:`kvpool.engine.EngineStore`: contiguous objects straight from and to
the engine's registered memory, segmented ones gathered into, or scattered from, one registered
staging buffer (the copy a GPU deployment makes between device and pinned host memory anyway).
It never raises for a failed load or store (EngineStore answers False).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from .engine import EngineStore

log = logging.getLogger("kvpool.page_io")

_memmove = ctypes.memmove


class PageObjects:
    """The objects of one batch, in order: ``keys[i]``, the (pointer, size) segments of host
    memory that hold object ``i`` in byte order (``segs[i]``), the index of its page
    (``pages[i]``) and whether it is shared by every tensor-parallel rank (``shared[i]``)."""

    __slots__ = ("keys", "pages", "segs", "shared")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.segs: list[list[tuple[int, int]]] = []
        self.pages: list[int] = []
        self.shared: list[bool] = []

    def add(
        self, key: str, segs: list[tuple[int, int]], page: int, shared: bool
    ) -> None:
        self.keys.append(key)
        self.segs.append(segs)
        self.pages.append(page)
        self.shared.append(shared)

    def extend(self, other: PageObjects) -> None:
        self.keys += other.keys
        self.segs += other.segs
        self.pages += other.pages
        self.shared += other.shared

    def nbytes(self, i: int) -> int:
        return sum(sz for _, sz in self.segs[i])

    @staticmethod
    def per_page(pages: list[int], ok: list[bool], n: int) -> list[bool]:
        """Per page ``0..n``, whether every object of it (``pages[i]`` for ``ok[i]``) is ok."""
        out = [True] * n
        for p, o in zip(pages, ok):
            if not o:
                out[p] = False
        return out


class PageIO:
    """Loads and stores :class:`PageObjects` through ``store``.

    ``staging_bytes`` is the staging buffer's usual size (the engine's batch of pages); when it
    is 0 the buffer is sized to the call. The buffer is allocated and registered on first use,
    grown when one call needs more, shared by loads and stores (one at a time) and released by
    :meth:`close`.
    """

    def __init__(self, store: EngineStore, staging_bytes: int = 0):
        self.store = store
        self.staging_bytes = staging_bytes
        self.staging: torch.Tensor | None = None
        self._lock = threading.Lock()

    def load(self, objs: PageObjects) -> list[bool]:
        """Loads every object into its segments; per object, whether it filled them exactly."""
        ok = [False] * len(objs.keys)
        self._move(objs, range(len(objs.keys)), ok, store=False)
        return ok

    def save(self, objs: PageObjects, skip_shared: bool = False) -> list[bool]:
        """Stores the objects kvpool does not hold yet (one presence round trip first); per
        object, whether it is stored now. With ``skip_shared`` the rank-shared objects are
        left to their writer rank and reported True."""
        n = len(objs.keys)
        ok = [skip_shared and objs.shared[i] for i in range(n)]
        ask = [i for i in range(n) if not ok[i]]
        present = self.store.presence([objs.keys[i] for i in ask])
        todo = []
        for i, p in zip(ask, present):
            if p:
                ok[i] = True
            else:
                todo.append(i)
        self._move(objs, todo, ok, store=True)
        return ok

    def close(self) -> None:
        """Releases the staging buffer (the store's registration goes with the store)."""
        with self._lock:
            self.staging = None

    def _move(
        self, objs: PageObjects, which: range | list[int], ok: list[bool], store: bool
    ) -> None:
        direct = [i for i in which if len(objs.segs[i]) == 1]
        if direct:
            keys = [objs.keys[i] for i in direct]
            ptrs = [objs.segs[i][0][0] for i in direct]
            sizes = [objs.segs[i][0][1] for i in direct]
            done = (
                self.store.save(keys, ptrs, sizes)
                if store
                else self.store.load(keys, ptrs, sizes)
            )
            for i, d in zip(direct, done):
                ok[i] = d
        staged = [i for i in which if len(objs.segs[i]) > 1]
        if staged:
            self._staged(objs, staged, ok, store)

    def _staged(
        self, objs: PageObjects, which: list[int], ok: list[bool], store: bool
    ) -> None:
        """Moves segmented objects through the staging buffer, as many at a time as it holds:
        gather then store, or load then scatter."""
        sizes = {i: objs.nbytes(i) for i in which}
        need = max(max(sizes.values()), self.staging_bytes or sum(sizes.values()))
        with self._lock:
            staging = self._ensure_staging(need)
            if staging is None:
                return
            base, cap = staging.data_ptr(), staging.numel()
            pos = 0
            while pos < len(which):
                chunk, used = [], 0
                while pos < len(which) and used + sizes[which[pos]] <= cap:
                    chunk.append((which[pos], base + used))
                    used += sizes[which[pos]]
                    pos += 1
                keys = [objs.keys[i] for i, _ in chunk]
                dsts = [d for _, d in chunk]
                lens = [sizes[i] for i, _ in chunk]
                if store:
                    for i, dst in chunk:
                        for ptr, sz in objs.segs[i]:
                            _memmove(dst, ptr, sz)
                            dst += sz
                    done = self.store.save(keys, dsts, lens)
                else:
                    done = self.store.load(keys, dsts, lens)
                    for (i, src), d in zip(chunk, done):
                        if d:
                            for ptr, sz in objs.segs[i]:
                                _memmove(ptr, src, sz)
                                src += sz
                for (i, _), d in zip(chunk, done):
                    ok[i] = d

    def _ensure_staging(self, need: int) -> torch.Tensor | None:
        """The staging buffer, at least ``need`` bytes; caller holds the lock."""
        if self.staging is not None and self.staging.numel() >= need:
            return self.staging
        if self.staging is not None:
            self.store.unregister(self.staging.data_ptr())
            self.staging = None
        buf = torch.empty(need, dtype=torch.uint8)
        if not self.store.register(buf.data_ptr(), need):
            return None
        self.staging = buf
        log.info("kvpool: %.1f MiB staging buffer for segmented pages", need / 2**20)
        return buf

"""The SGLang backend's v2 calls: the sidecar pools of hybrid models (Mamba state, sliding-window
and draft KV, indexers), each restored under its own hit policy."""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from ._sglang_guard import _guarded, _per_pool_false
from .page_io import PageObjects


class HybridPools:
    """``KvpoolStore``'s v2 calls (mixed into it)."""

    @_guarded(lambda *a, **k: PoolTransferResult.empty())
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix under each pool's hit policy (one presence round trip for every
        object of every pool). ``BLOCK_GROUPS`` pools restore 0 pages and gate nothing."""
        n = len(keys)
        if n == 0:
            return PoolTransferResult(0, {}, [])
        physical = getattr(self.mem_pool_host, "kv_buffer", None) is not None
        query: list[str] = []
        spans: list[tuple[PoolTransfer | None, int, int, int]] = []
        if physical:
            comps = self._kv_components()
            query += [self._key(k, c, s) for k in keys for c, s in comps]
            spans.append((None, len(comps), 0, len(query)))
        unusable = False
        for t in pool_transfers or []:
            if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                self._log_once(
                    f"block_groups:{t.name}",
                    "kvpool: pool %s asks for BLOCK_GROUPS, which kvpool does not serve; "
                    "it restores 0 pages",
                    t.name,
                )
                continue
            pool = self.registered_pools.get(t.name)
            comps = self._components(t.name, pool) if pool is not None else None
            if not comps:
                unusable = True  # a pool we can't serve restores nothing
                continue
            begin = len(query)
            query += [self._key(k, c, s) for k in keys for c, s in comps]
            spans.append((t, len(comps), begin, len(query)))
        present = self.store.presence(query) if query else []

        def pages_present(mult: int, begin: int) -> list[bool]:
            return [
                all(present[begin + i * mult : begin + (i + 1) * mult])
                for i in range(n)
            ]

        kv_pages = n
        if physical:
            kv = pages_present(spans[0][1], 0)
            kv_pages = kv.index(False) if False in kv else n
            spans = spans[1:]
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = [] if unusable else list(range(1, kv_pages + 1))
        for t, mult, begin, _end in spans:
            if not restorable:
                break
            assert t is not None
            have = pages_present(mult, begin)[:kv_pages]
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {
                    p
                    for p in range(1, kv_pages + 1)
                    if all(have[max(0, p - window) : p])
                }
            else:  # ALL_PAGES
                lead = have.index(False) if False in have else kv_pages
                ok = set(range(1, lead + 1))
            if ok:
                hits[t.name] = max(ok)
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    @_guarded(_per_pool_false)
    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Loads each transfer's pages into its pool: per pool, per page, whether it loaded."""
        return self._io_v2(transfers, store=False)

    @_guarded(_per_pool_false)
    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Stores each transfer's pages from its pool (existing objects are skipped)."""
        return self._io_v2(transfers, store=True)

    def _io_v2(
        self, transfers: list[PoolTransfer], store: bool
    ) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        batch = PageObjects()
        spans: list[tuple[Any, int, int, int]] = []
        for t in transfers:
            nkeys = len(t.keys or [])
            out[t.name] = [False] * nkeys
            pool = self.registered_pools.get(t.name)
            if pool is None or nkeys == 0 or t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                continue
            if t.name == PoolName.KV and getattr(pool, "kv_buffer", None) is None:
                out[t.name] = [True] * nkeys
                continue
            objs = self._objects(t.name, pool, list(t.keys or []), t.host_indices)
            if objs is None:
                continue
            begin = len(batch.keys)
            batch.extend(objs)
            spans.append((t.name, nkeys, begin, len(batch.keys)))
        if not batch.keys:
            return out
        skip = self.is_mla and not self.is_writer
        ok = self.io.save(batch, skip_shared=skip) if store else self.io.load(batch)
        for name, nkeys, begin, end in spans:
            out[name] = PageObjects.per_page(
                batch.pages[begin:end], ok[begin:end], nkeys
            )
        return out

"""kvpool as SGLang's HiCache L3 storage: :class:`KvpoolStore`, a real ``HiCacheStorage``.

SGLang loads it by its dynamic backend factory (sglang 0.5.23)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"kvpool","module_path":"kvpool.sglang","class_name":"KvpoolStore",
      "interface_v1":1,"kvpool_url":"tcp://127.0.0.1:7070"}'

and calls it from the scheduler's storage threads: ``batch_exists`` from the prefetch thread,
``batch_get_v1`` from the prefetch I/O thread, ``batch_set_v1`` from the backup thread, and the v2
calls for the sidecar pools of hybrid models. Every call after the attach answers a miss or a
``False`` on any failure (the daemon down, slow, full, a bad argument): no exception reaches
those threads. A bad ``extra_config`` or an unsupported host layout raises at the attach, loudly.

**Objects and keys.** One object per page and component, Mooncake's scheme behind a salt:
``{salt}_{page_hash}_{tp_rank}_k`` and ``_v`` for MHA (each rank holds its heads),
``{salt}_{page_hash}__k`` for MLA (one latent, shared by every tensor-parallel rank; only the
storage writer puts it). The salt is :func:`kvpool.engine.layout_salt` of the model, dtype, page
size, layer and head geometry, the parallel sizes, ``extra_backend_tag`` and the byte order of
the objects. The byte order is a property of the host layout: ``page_first`` objects hold their
bytes token-major (``[page_size, layers, ...]``) and ``layer_first`` and ``page_first_direct``
ones layer-major (``[layers, page_size, ...]``). We salt by it rather than canonicalising,
because canonicalising ``page_first`` would put a transposing copy on every load and store of
SGLang's zero-copy layout; ``layer_first`` and ``page_first_direct`` objects hold the same bytes,
so they share keys.

**Zero copy.** Where a page's object is one contiguous range of the host pool (``page_first``,
``page_first_direct``: K and V each contiguous; MLA one range), it is loaded and stored straight
from and to the pool's registered memory. Where it is not (``layer_first``: one segment per
layer), it is gathered into, or scattered from, one registered staging buffer sized for a batch
of 128 pages (:data:`STORAGE_BATCH_SIZE`), the same copy a GPU deployment makes between device and
pinned host memory.

**Metrics.** :meth:`KvpoolStore.get_stats` returns SGLang's ``StorageMetrics`` (pages and GiB/s of
each prefetch and backup batch, drained per call, filled when ``enable_storage_metrics``);
:meth:`KvpoolStore.kvpool_stats` returns the EngineStore counters (hits, misses, errors, bytes,
load latency, breaker state) plus this backend's own (``guarded_errors``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from ._sglang_config import BYTE_ORDER, CONFIG_DEFAULTS, _parse_config
from ._sglang_guard import _all_false, _guarded
from ._sglang_hybrid import HybridPools
from ._sglang_plain import PlainInterface
from .engine import EngineStore, layout_salt
from .page_io import PageIO, PageObjects

__all__ = ["BYTE_ORDER", "CONFIG_DEFAULTS", "KvpoolStore"]

log = logging.getLogger("kvpool.sglang")

#: Pools whose one object per page is the rank-replicated kind under an MLA model.
_MLA_SINGLE_POOLS = frozenset(
    {
        PoolName.INDEXER,
        PoolName.DRAFT_INDEXER,
        *(p for p in PoolName if p.value.startswith("deepseek_v4_")),
    }
)


class KvpoolStore(HybridPools, PlainInterface, HiCacheStorage):
    """SGLang HiCache storage backed by kvpool (see the module docstring and docs/ENGINES.md).

    ``KvpoolStore(storage_config, kwargs=None)``: the signature SGLang's dynamic factory calls.
    ``storage_config.extra_config`` carries the settings of :data:`CONFIG_DEFAULTS`. The store
    connects lazily and never fails because kvpoold is down: it answers misses until a probe
    connects. Its v2 calls are in ``HybridPools``, its plain ones in ``PlainInterface``.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None
    ):
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError("KvpoolStore needs a HiCacheStorageConfig")
        if storage_config.should_split_heads:
            raise ValueError(
                "kvpool does not support tp_lcm_size head splitting (page_head layout)"
            )
        extra = dict(storage_config.extra_config or {})
        self.config = _parse_config(extra)
        self.storage_config = storage_config
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        self.registered_pools: dict[Any, Any] = {}
        self.mem_pool_host: Any = None
        sc = storage_config
        self._base_fields: dict[str, Any] = {
            "engine": "sglang",
            "model": sc.model_name or "",
            "tag": extra.get("extra_backend_tag"),
            "mla": self.is_mla,
            "tp_size": None if self.is_mla else sc.tp_size,
            "pp_size": sc.pp_size,
            "cp_size": sc.attn_cp_size,
            "dcp_size": sc.dcp_size,
            "logical_page": sc.logical_page_size if sc.dcp_size > 1 else None,
        }
        self.salt = layout_salt(**self._base_fields)
        # Mooncake's rank suffixes: MHA objects per tp (and pp) rank, MLA ones per pp stage.
        mha, mla = [str(sc.tp_rank)], []
        if sc.dcp_size > 1 or sc.attn_cp_size > 1:
            mla.append(f"dcp{sc.dcp_rank}_cp{sc.attn_cp_rank}")
            mha.append(f"cp{sc.attn_cp_rank}")
        if sc.pp_size > 1:
            mha.append(str(sc.pp_rank))
            mla.append(str(sc.pp_rank))
        self.mha_suffix = "_".join(mha)
        self.mla_suffix = "_".join(mla)
        self.store = EngineStore(
            self.config["kvpool_url"],
            self.config["kvpool_namespace"],
            self.config["kvpool_token"],
            lookup_timeout=self.config["lookup_timeout_ms"] / 1000.0,
            io_timeout=self.config["io_timeout_ms"] / 1000.0,
            failure_threshold=self.config["failure_threshold"],
            probe_interval=self.config["probe_interval_s"],
            same_host=self.config["kvpool_same_host"],
            name="kvpool (sglang)",
        )
        self.io = PageIO(self.store)  # its staging buffer is sized at registration
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self._logged: set[str] = set()
        self._attached = (
            False  # on_host_pools_registered fired: from now on, never raise
        )
        self.guarded_errors = 0
        log.info(
            "kvpool HiCache storage at %s (salt %s, %s, rank suffix %r)",
            self.config["kvpool_url"],
            self.salt,
            "MLA" if self.is_mla else "MHA",
            self.mla_suffix if self.is_mla else self.mha_suffix,
        )

    # ----- registration (may raise: a misconfiguration fails the attach) -----

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the anchor host pool: its buffers with kvpool, and its dtype, page size,
        geometry and layout into the key salt."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            return  # a logical anchor: its physical pools come through v2
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in BYTE_ORDER:
            raise ValueError(
                f"kvpool supports the host layouts {sorted(BYTE_ORDER)}, not {layout!r}"
            )
        fields = dict(self._base_fields)
        fields.update(
            dtype=str(mem_pool_host.dtype),
            page_size=mem_pool_host.page_size,
            order=BYTE_ORDER[layout],
            layers=getattr(mem_pool_host, "layer_num", None),
            heads=getattr(mem_pool_host, "head_num", None),
            head_dim=getattr(mem_pool_host, "head_dim", None),
            kv_cache_dim=getattr(mem_pool_host, "kv_cache_dim", None),
        )
        self.salt = layout_salt(**fields)
        self._register_buffers(mem_pool_host)
        if layout == "layer_first":
            pages = max(
                1,
                min(STORAGE_BATCH_SIZE, mem_pool_host.size // mem_pool_host.page_size),
            )
            per_page = mem_pool_host.get_size_per_token() * mem_pool_host.page_size
            self.io.staging_bytes = pages * per_page
        self.registered_pools[PoolName.KV] = mem_pool_host
        log.info("kvpool: registered the %s host pool; key salt %s", layout, self.salt)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Registers a hybrid model's host pool (KV anchor or sidecar) by its name. During the
        attach a bad pool raises; a sidecar registered later (SGLang adds them at run time)
        is logged and left unregistered instead, so its transfers answer misses."""
        try:
            if host_pool_name == PoolName.KV and host_pool is self.mem_pool_host:
                self.registered_pools[host_pool_name] = host_pool
                return
            self._register_buffers(host_pool)
            self.registered_pools[host_pool_name] = host_pool
        except Exception as e:
            if not self._attached:
                raise
            self._guard_failed("register_mem_host_pool_v2", e)

    def on_host_pools_registered(self) -> None:
        """The initial registration burst is over. Under a logical KV anchor (no KV memory
        of its own) the salt is finalised here from the physical pools' layouts, dtypes and
        page sizes, since the anchor has none."""
        self._attached = True
        anchor = self.mem_pool_host
        if anchor is not None and getattr(anchor, "kv_buffer", None) is None:
            pools = sorted(
                (
                    str(name),
                    str(getattr(pool, "layout", None)),
                    str(getattr(pool, "dtype", None)),
                    getattr(pool, "page_size", None),
                )
                for name, pool in self.registered_pools.items()
            )
            self.salt = layout_salt(**self._base_fields, pools=pools)
        log.info(
            "kvpool: host pools %s; key salt %s",
            [str(n) for n in self.registered_pools],
            self.salt,
        )

    def _register_buffers(self, pool: Any) -> None:
        bufs = getattr(pool, "get_hybrid_pool_buffer", None)
        tensors = bufs() if bufs is not None else [getattr(pool, "kv_buffer", None)]
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            if t.device.type != "cpu":
                raise ValueError("kvpool registers host (CPU) memory only")
            self.store.register(t.data_ptr(), t.numel() * t.element_size())

    # ----- zero-copy interface (interface_v1) -----

    @_guarded(lambda *a, **k: 0)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages are stored: one ``match_prefix`` on their objects' keys."""
        if not keys:
            return 0
        if not self.zero_copy:
            return self.store.match_prefix([self._plain_key(k) for k in keys])
        comps = self._kv_components()
        query = [self._key(k, c, s) for k in keys for c, s in comps]
        return self.store.match_prefix(query) // len(comps)

    @_guarded(_all_false)
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Loads page ``i`` of ``keys`` into the host pool at ``host_indices[i*page_size]``."""
        if not keys:
            return []
        pool = self.mem_pool_host
        if pool.kv_buffer is None:
            return [True] * len(keys)  # a logical anchor: v2 side pools carry the data
        start = time.perf_counter()
        objs = self._objects(PoolName.KV, pool, keys, host_indices)
        if objs is None:
            return [False] * len(keys)
        ok = self.io.load(objs)
        pages = PageObjects.per_page(objs.pages, ok, len(keys))
        self._record(self._prefetch_pgs, self._prefetch_bw, objs, ok, pages, start)
        return pages

    @_guarded(_all_false)
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys``; pages already
        stored are skipped, and MLA ranks that are not the storage writer put nothing."""
        if not keys:
            return []
        pool = self.mem_pool_host
        if pool.kv_buffer is None:
            return [True] * len(keys)
        if self.is_mla and not self.is_writer:
            return [True] * len(keys)
        start = time.perf_counter()
        objs = self._objects(PoolName.KV, pool, keys, host_indices)
        if objs is None:
            return [False] * len(keys)
        ok = self.io.save(objs, skip_shared=self.is_mla and not self.is_writer)
        pages = PageObjects.per_page(objs.pages, ok, len(keys))
        self._record(self._backup_pgs, self._backup_bw, objs, ok, pages, start)
        return pages

    @_guarded(lambda *a, **k: False)
    def exists(self, key: str) -> bool:
        """Whether page ``key`` is stored (its objects under interface_v1, else its value)."""
        return self.batch_exists([key]) == 1

    @_guarded(lambda *a, **k: False)
    def clear(self) -> bool:
        """Removes every object of this store's kvpool namespace (all models in it)."""
        # EngineStore.clear answers 0 both for an empty namespace and a failure: ask through
        # its breaker directly to tell them apart.
        return self.store._call(1, lambda c: c.clear() >= 0, False)

    @_guarded(lambda *a, **k: StorageMetrics())
    def get_stats(self) -> StorageMetrics:
        """SGLang's StorageMetrics since the last call (empty unless enable_storage_metrics)."""
        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for lst in (
                self._prefetch_pgs,
                self._backup_pgs,
                self._prefetch_bw,
                self._backup_bw,
            ):
                lst.clear()
        return m

    def kvpool_stats(self) -> dict[str, Any]:
        """The EngineStore counters (see kvpool.engine.Counters), ``available`` (breaker
        closed) and ``guarded_errors`` (exceptions this backend turned into misses)."""
        try:
            out = self.store.stats()
        except Exception:  # noqa: BLE001
            out = {}
        out["guarded_errors"] = self.guarded_errors
        return out

    @_guarded(lambda *a, **k: None)
    def close(self) -> None:
        """Closes the client and releases the staging buffer; later calls answer misses."""
        self.store.close()
        self.io.close()

    # ----- keys -----

    def _key(self, page_key: str, component: str, shared: bool) -> str:
        sfx = self.mla_suffix if shared else self.mha_suffix
        return f"{self.salt}_{page_key}_{sfx}_{component}"

    def _plain_key(self, key: str) -> str:
        """A whole flat page (SGLang's generic path): never the same as an object key."""
        sfx = self.mla_suffix if self.is_mla else self.mha_suffix
        return f"{self.salt}_{key}_{sfx}"

    def _kv_components(self) -> list[tuple[str, bool]]:
        if self.is_mla:
            return [("k", True)]
        return [("k", False), ("v", False)]

    def _components(self, name: Any, pool: Any) -> list[tuple[str, bool]]:
        """The objects of one page of pool ``name``: (component, rank-shared), in the order of
        the pool's ``get_page_buffer_meta`` segments (Mooncake's suffix table)."""
        if name == PoolName.KV:
            return self._kv_components()
        label = str(name)
        mha_like = isinstance(pool, MHATokenToKVPoolHost) or (
            hasattr(pool, "v_buffer") and not hasattr(pool, "kv_cache_dim")
        )
        if name == PoolName.MAMBA:  # TP-sharded even under an MLA model
            comps = [
                (f"conv_{i}", False)
                for i in range(len(getattr(pool, "conv_buffer", None) or []))
            ]
            if getattr(pool, "temporal_state_elem_size", 1) > 0:
                comps.insert(0, ("temporal", False))
            return comps
        if name in (PoolName.DRAFT, PoolName.DRAFT_SWA, PoolName.SWA) and mha_like:
            base = "draft" if name == PoolName.DRAFT else label
            return [(f"{base}_k", False), (f"{base}_v", False)]
        if name == PoolName.DRAFT:
            return [("draft_k", True)]
        if name in _MLA_SINGLE_POOLS:
            return [(label, True)]
        return [(label, self.is_mla)]

    # ----- objects and their memory -----

    def _objects(
        self, name: Any, pool: Any, keys: list[str], host_indices: torch.Tensor | None
    ) -> PageObjects | None:
        """The objects of ``keys`` in ``pool`` at ``host_indices``; None (logged) when the
        indices or the pool's segments don't match the keys."""
        n = len(keys)
        page = getattr(pool, "page_size", 1) or 1
        if name == PoolName.KV and self.storage_config.dcp_size > 1:
            page = self.storage_config.logical_page_size or page
        if host_indices is None or host_indices.numel() != n * page:
            self._log_once(
                f"indices:{name}",
                "kvpool: pool %s got %s host indices for %d pages of %d tokens",
                name,
                None if host_indices is None else host_indices.numel(),
                n,
                page,
            )
            return None
        comps = self._components(name, pool)
        if not comps:
            return None
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per_page, rem = divmod(len(ptrs), n)
        if rem or per_page % len(comps) or len(sizes) != len(ptrs):
            self._log_once(
                f"meta:{name}",
                "kvpool: pool %s gave %d segments for %d pages of %d objects",
                name,
                len(ptrs),
                n,
                len(comps),
            )
            return None
        nseg = per_page // len(comps)
        # MHA layer_first interleaves K and V per layer: k0 v0 k1 v1 ...; each object takes
        # its own component's layers, so it holds the bytes of a page_first_direct object.
        interleaved = (
            nseg > 1
            and len(comps) == 2
            and getattr(pool, "layout", "") == "layer_first"
        )
        objs = PageObjects()
        for i, k in enumerate(keys):
            base = i * per_page
            for j, (comp, shared) in enumerate(comps):
                if interleaved:
                    idx = range(base + j, base + per_page, len(comps))
                else:
                    idx = range(base + j * nseg, base + (j + 1) * nseg)
                segs = [(int(ptrs[x]), int(sizes[x])) for x in idx]
                objs.add(self._key(k, comp, shared), segs, i, shared)
        return objs

    # ----- helpers -----

    def _record(
        self,
        pgs: list[int],
        bw: list[float],
        objs: PageObjects,
        ok: list[bool],
        pages: list[bool],
        start: float,
    ) -> None:
        """One batch's pages and GiB/s into SGLang's metrics (when it asked for them)."""
        if not self.enable_storage_metrics:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        nbytes = sum(sum(sz for _, sz in s) for s, o in zip(objs.segs, ok) if o)
        with self._metrics_lock:
            pgs.append(sum(pages))
            bw.append(nbytes / elapsed / 2**30)

    def _guard_failed(self, method: str, e: BaseException) -> None:
        self.guarded_errors += 1
        self.store.counters.add(errors=1)
        if method not in self._logged:
            self._logged.add(method)
            log.warning(
                "kvpool: %s failed (%r); answering a miss", method, e, exc_info=e
            )
        else:
            log.debug("kvpool: %s failed: %r", method, e)

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

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

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from .engine import EngineStore, layout_salt
from .page_io import PageIO, PageObjects

log = logging.getLogger("kvpool.sglang")

#: ``extra_config`` keys this backend reads, with their defaults (docs/ENGINES.md).
CONFIG_DEFAULTS: dict[str, Any] = {
    "kvpool_url": None,  # or $KVPOOL_URL
    "kvpool_namespace": None,  # kvpoold's "default"
    "kvpool_token": None,
    "lookup_timeout_ms": 5.0,
    "io_timeout_ms": 2000.0,
    "failure_threshold": 3,
    "probe_interval_s": 5.0,
    "kvpool_same_host": True,  # False: every byte over the socket, as from another host
}

#: Host layouts by the byte order of their objects (the salt's ``order`` field).
BYTE_ORDER = {
    "page_first": "token-major",
    "layer_first": "layer-major",
    "page_first_direct": "layer-major",
}

#: Pools whose one object per page is the rank-replicated kind under an MLA model.
_MLA_SINGLE_POOLS = frozenset(
    {
        PoolName.INDEXER,
        PoolName.DRAFT_INDEXER,
        *(p for p in PoolName if p.value.startswith("deepseek_v4_")),
    }
)


def _parse_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The backend's settings from ``extra_config``; raises ValueError on a bad one."""
    unknown = [k for k in extra if k.startswith("kvpool_") and k not in CONFIG_DEFAULTS]
    if unknown:
        raise ValueError(
            f"unknown kvpool extra_config keys {unknown}; known: {sorted(CONFIG_DEFAULTS)}"
        )
    cfg = dict(CONFIG_DEFAULTS)
    cfg.update({k: extra[k] for k in CONFIG_DEFAULTS if k in extra})
    url = cfg["kvpool_url"] or os.environ.get("KVPOOL_URL")
    if not isinstance(url, str) or not url:
        raise ValueError(
            "kvpool: set kvpool_url in --hicache-storage-backend-extra-config "
            "(or KVPOOL_URL), e.g. tcp://127.0.0.1:7070"
        )
    cfg["kvpool_url"] = url
    for k in ("lookup_timeout_ms", "io_timeout_ms", "probe_interval_s"):
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"kvpool: {k} must be a positive number, got {v!r}")
    ft = cfg["failure_threshold"]
    if isinstance(ft, bool) or not isinstance(ft, int) or ft < 1:
        raise ValueError(
            f"kvpool: failure_threshold must be an integer >= 1, got {ft!r}"
        )
    for k in ("kvpool_namespace", "kvpool_token"):
        if cfg[k] is not None and not isinstance(cfg[k], str):
            raise ValueError(f"kvpool: {k} must be a string")
    if type(cfg["kvpool_same_host"]) is not bool:  # ValueError, as for every bad key
        raise ValueError("kvpool: kvpool_same_host must be true or false")
    return cfg


def _guarded(miss: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Turns any exception of a public method into ``miss(*args)``, counted and logged once
    per method (then at debug level)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: KvpoolStore, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 (SGLang's threads must only see a miss)
                self._guard_failed(fn.__name__, e)
                try:
                    return miss(*args, **kwargs)
                except Exception:  # noqa: BLE001 (malformed arguments: the emptiest miss)
                    return miss()

        return wrapper

    return deco


def _n_keys(keys: Sequence[Any] | None = None, *_: Any, **__: Any) -> int:
    try:
        return len(keys) if keys is not None else 0
    except TypeError:
        return 0


def _all_false(*args: Any, **kwargs: Any) -> list[bool]:
    return [False] * _n_keys(*args, **kwargs)


def _per_pool_false(
    transfers: Sequence[PoolTransfer] | None = None, *_: Any, **__: Any
) -> dict[str, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


def _tensor_bytes(t: torch.Tensor, writable: bool = False) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 CPU tensor: a view of ``t`` to write into (which
    must then be a contiguous CPU tensor), or its bytes to read (a copy where needed)."""
    if writable:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("kvpool: a get target must be a contiguous CPU tensor")
        return t.reshape(-1).view(torch.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _batch_get_miss(
    keys: Sequence[Any] | None = None,
    target_locations: Any = None,
    target_sizes: Any = None,
) -> list[None] | int:
    if target_locations is not None and target_sizes is not None:
        return 0
    return [None] * _n_keys(keys)


class KvpoolStore(HiCacheStorage):
    """SGLang HiCache storage backed by kvpool (see the module docstring and docs/ENGINES.md).

    ``KvpoolStore(storage_config, kwargs=None)``: the signature SGLang's dynamic factory calls.
    ``storage_config.extra_config`` carries the settings of :data:`CONFIG_DEFAULTS`. The store
    connects lazily and never fails because kvpoold is down: it answers misses until a probe
    connects.
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

    # ----- v2: hybrid models' sidecar pools -----

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

    # ----- plain interface (SGLang's generic path, without interface_v1) -----

    @_guarded(lambda *a, **k: None)
    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> Any:
        """The value of ``key``: into ``target_location`` when it is a CPU tensor (the tensor,
        or None); into registered memory when it is a pointer with ``target_sizes`` bytes
        (True, or False); as a new uint8 tensor without a target (or None)."""
        pk = self._plain_key(key)
        if isinstance(target_location, torch.Tensor):
            view = _tensor_bytes(target_location, writable=True)
            got = self.store.get_many_into([pk], [view.numpy()])
            expect = target_location.numel() * target_location.element_size()
            return target_location if got[0] == expect else None
        if target_location is not None:
            ptr, size = self._pointer(target_location, target_sizes)
            return self.store.load([pk], [ptr], [size])[0]
        v = self.store.get(pk)
        return None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)

    @_guarded(_batch_get_miss)
    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None] | int:
        """``get`` for many keys in one round trip. Tensors (SGLang's generic path): the list
        of filled tensors or None. Pointers with sizes (Mooncake's form): how many leading
        keys were loaded."""
        if not keys:
            return []
        pks = [self._plain_key(k) for k in keys]
        if target_sizes is not None and target_locations is not None:
            ptrs = [self._pointer(p, s) for p, s in zip(target_locations, target_sizes)]
            ok = self.store.load(pks, [p for p, _ in ptrs], [s for _, s in ptrs])
            return ok.index(False) if False in ok else len(ok)
        if target_locations is None:
            return [self.get(k) for k in keys]
        views = [_tensor_bytes(t, writable=True) for t in target_locations]
        got = self.store.get_many_into(pks, [v.numpy() for v in views])
        return [
            t if g == v.numel() else None
            for t, v, g in zip(target_locations, views, got)
        ]

    @_guarded(lambda *a, **k: False)
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Stores a tensor (or any buffer) ``value``, or ``target_sizes`` bytes of registered
        memory at ``target_location``, under ``key``; True when stored or already there."""
        if value is None and target_location is None:
            return False
        return self.batch_set(
            [key],
            None if value is None else [value],
            None if target_location is None else [target_location],
            None if target_sizes is None else [target_sizes],
        )

    @_guarded(lambda *a, **k: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """``set`` for many keys (one presence and one store round trip); True when every
        key is stored. MLA ranks that are not the storage writer put nothing."""
        if not keys:
            return False
        if self.is_mla and not self.is_writer:
            return True
        pks = [self._plain_key(k) for k in keys]
        present = self.store.presence(pks)
        todo = [i for i, p in enumerate(present) if not p]
        if not todo:
            return True
        if values is not None:
            bufs = [
                _tensor_bytes(values[i]).numpy()
                if isinstance(values[i], torch.Tensor)
                else values[i]
                for i in todo
            ]
            return self.store.put_many([pks[i] for i in todo], bufs)
        if target_locations is None or target_sizes is None:
            return False
        ptrs = [self._pointer(target_locations[i], target_sizes[i]) for i in todo]
        ok = self.store.save(
            [pks[i] for i in todo], [p for p, _ in ptrs], [s for _, s in ptrs]
        )
        return all(ok)

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

    @staticmethod
    def _pointer(location: Any, size: Any) -> tuple[int, int]:
        """(pointer, size) from Mooncake's plain forms: an int or a one-element list each."""
        if isinstance(location, (list, tuple)):
            if len(location) != 1:
                raise ValueError("kvpool: one contiguous buffer per key")
            location = location[0]
        if isinstance(size, (list, tuple)):
            size = sum(size)
        ptr, n = int(location), int(size)
        if ptr <= 0 or n <= 0:
            raise ValueError("kvpool: a null pointer or an empty size")
        return ptr, n

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

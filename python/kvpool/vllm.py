"""kvpool as vLLM's KV cache store: a v1 KV connector for vllm 0.33.

Loaded by vLLM's connector factory with no code change in vLLM::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvpoolConnector",
        "kv_connector_module_path":"kvpool.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"kvpool_url":"tcp://127.0.0.1:7070"}}'

vLLM builds one :class:`KvpoolConnector` in its scheduler process and one in every worker
process (each tensor- and pipeline-parallel rank). They share no memory: the scheduler decides
what to load and save and sends it to the workers in :class:`KvpoolConnectorMetadata`; the
workers move the bytes and report back through vLLM's connector output.

**Keys.** One object per (block, rank): ``"{salt}@{block_hash.hex()}"``, where ``block_hash`` is
vLLM's own prefix-caching hash of the block (``request.block_hashes``: full blocks only, chained
from the first token, including LoRA, multimodal and ``cache_salt`` extra keys) and ``salt`` is
:func:`kvpool.engine.layout_salt` of the model, the cache dtype, the block size, the parallel
ranks and sizes, the layer and head geometry and the logical page layout. Two models, dtypes,
block sizes or ranks therefore never share a key. A partial last block has no hash and is never
stored. With a non-cryptographic prefix hash (``xxhash``/``xxhash_cbor``) and no
``PYTHONHASHSEED``, vLLM seeds its hashes at random per process, so no other process could ever
reuse them: the connector then neither looks up nor stores (one warning).

**Values.** The concatenation, over the worker's layers in model order, of each layer's page
for that block in vLLM's logical ``[heads, tokens, content]`` order (K and V of the block). It
is gathered from the paged KV cache into a registered host staging buffer (the copy a GPU
deployment makes into pinned memory anyway) and written with one ``EngineStore.save`` per batch;
loads go the other way, except into a host-memory cache, whose registered pages each object
is loaded into directly (``EngineStore.load_scattered``: copied from kvpoold's memory on its
host, received from the socket elsewhere).

**Asynchrony.** Loads run on a loader thread. By default (``load_async``) the scheduler parks the
request in ``WAITING_FOR_REMOTE_KVS`` while other requests compute, and the worker reports it in
``finished_recving`` when its blocks are in place; with ``load_async: false`` the request is
scheduled at once and ``start_load_kv`` (called before the forward) waits for its load. Saves
gather the new full blocks into staging
inside ``wait_for_save`` (so the source blocks are never read after vLLM may free or reuse them,
and ``request_finished`` never needs to hold blocks) and a saver thread writes them to kvpool
while the next steps compute. Any failure is a miss: a block that fails to load is returned by
``get_block_ids_with_load_errors`` and vLLM recomputes it; a save that fails is a future miss.

**HMA.** The class does not declare ``SupportsHMA``: vLLM then turns its hybrid KV cache manager
off, so the cache has exactly one group (sliding-window layers then keep blocks for the whole
sequence; Mamba/SSM models refuse to start with this connector). See docs/ENGINES.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from .engine import Counters, EngineStore, layout_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

_memmove = ctypes.memmove

#: ``kv_connector_extra_config`` keys and their defaults (docs/ENGINES.md repeats them).
DEFAULTS: dict[str, Any] = {
    "kvpool_url": "tcp://127.0.0.1:7070",
    "namespace": None,
    "token": None,
    "lookup_timeout": 0.005,
    "io_timeout": 2.0,
    "failure_threshold": 3,
    "probe_interval": 5.0,
    "same_host": True,
    "load_async": True,
    "staging_blocks": 64,
    "batch_blocks": 16,
    "model_id": None,
    "keep_failure_policy": False,
}

_NON_REPRODUCIBLE_HASHES = ("xxhash", "xxhash_cbor")

T = TypeVar("T")


def _guarded(
    default: Callable[[], Any],
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Runs a connector method so that no exception reaches vLLM: on any error the method
    answers ``default()`` (a miss) and the error is logged (the first one as a warning)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(self: KvpoolConnector, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 (vLLM must only ever see a miss)
                self._note_error(fn.__name__, e)
                return default()

        return run

    return wrap


def _page_bytes(spec: Any) -> int:
    """Bytes of one block of one layer, without the padding some specs add for alignment (the
    per-layer views vLLM hands over exclude it)."""
    return int(getattr(spec, "unpadded_page_size_bytes", spec.page_size_bytes))


# ----- what the scheduler sends the workers -----


@dataclass
class BlockJob:
    """Blocks of one request to move: ``block_ids[i]`` holds the block whose vLLM hash is
    ``hashes[i]`` (hex)."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: loads (with ``load_async``: the request waits for
    them) and saves of blocks that became full this step."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    load_async: bool = True


# ----- stats -----


#: EngineStore's counters that travel to vLLM's logger, then the connector's own: how many
#: loads and their seconds, blocks vLLM recomputes after a failed load, saves dropped.
_STORE_FIELDS = tuple(f for f in Counters.FIELDS if f != "breaker_opened")
_STAT_FIELDS = (
    *_STORE_FIELDS,
    "load_count",
    "load_seconds",
    "load_failed_blocks",
    "save_dropped_blocks",
)


@dataclass
class KvpoolConnectorStats(KVConnectorStats):
    """Counters of one interval, summed over workers (``aggregate``) and reduced by vLLM's
    logger (``reduce``). ``data`` holds the fields of ``_STAT_FIELDS``."""

    def __post_init__(self) -> None:
        for k in _STAT_FIELDS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_STAT_FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KvpoolConnectorStats:
        for k in _STAT_FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n = d.get("load_count", 0)
        out: dict[str, int | float] = {
            k: d.get(k, 0)
            for k in _STAT_FIELDS
            if k not in ("load_seconds", "load_count")
        }
        out["loads"] = n
        out["avg_load_ms"] = (
            round(1000.0 * d.get("load_seconds", 0.0) / n, 3) if n else 0.0
        )
        looked = d.get("hits", 0) + d.get("misses", 0)
        out["hit_rate"] = round(d.get("hits", 0) / looked, 4) if looked else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _STAT_FIELDS)


#: The Prometheus counters the connector adds to vLLM's ``/metrics`` (``vllm:kvpool_<field>``),
#: from the fields of ``_STAT_FIELDS``: (field, name suffix, help).
_PROM_COUNTERS = (
    ("lookups", "lookups", "kvpool prefix lookups (one match_prefix call each)"),
    ("hits", "hit_blocks", "blocks (objects) loaded from kvpool"),
    ("misses", "missed_blocks", "blocks asked of kvpool and not loaded"),
    ("errors", "errors", "failed kvpool calls (each a miss or a dropped save)"),
    ("skipped", "skipped_calls", "calls answered as misses while the breaker was open"),
    ("stores", "stored_blocks", "blocks stored in kvpool"),
    ("store_failures", "store_failed_blocks", "blocks kvpool did not store"),
    ("bytes_read", "read_bytes", "bytes loaded from kvpool"),
    ("bytes_written", "written_bytes", "bytes stored in kvpool"),
    (
        "load_failed_blocks",
        "load_failed_blocks",
        "blocks vLLM recomputes after a failed load",
    ),
    (
        "save_dropped_blocks",
        "save_dropped_blocks",
        "saves dropped (no staging slot in time)",
    ),
)


class KvpoolPromMetrics(KVConnectorPromMetrics):
    """kvpool's counters in vLLM's own Prometheus registry: one ``vllm:kvpool_*_total`` counter
    per field, and the load latency as ``vllm:kvpool_load_seconds`` (its sum and count: vLLM
    hands the logger summed stats, not the single loads)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            f: self._counter_cls(
                name=f"vllm:kvpool_{suffix}",
                documentation=doc,
                labelnames=labelnames,
            )
            for f, suffix, doc in _PROM_COUNTERS
        }
        self._load_seconds = self._counter_cls(
            name="vllm:kvpool_load_seconds",
            documentation="seconds spent loading from kvpool (sum over loads)",
            labelnames=labelnames,
        )
        self._loads = self._counter_cls(
            name="vllm:kvpool_loads",
            documentation="loads from kvpool (batches of blocks)",
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0):
        if not transfer_stats_data:
            return
        labels = self.per_engine_labelvalues[engine_idx]
        for f, counter in self._counters.items():
            v = transfer_stats_data.get(f, 0)
            if v:
                counter.labels(*labels).inc(v)
        if transfer_stats_data.get("load_count", 0):
            self._loads.labels(*labels).inc(transfer_stats_data["load_count"])
            self._load_seconds.labels(*labels).inc(
                transfer_stats_data.get("load_seconds", 0.0)
            )


# ----- the connector -----


@dataclass
class _Tracked:
    """What the scheduler remembers of one request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # leading blocks known to be in kvpool (matched or saved)
    load: BlockJob | None = None
    load_first: int = 0  # index of the load's first block in the request
    no_load: bool = False  # a load of this request failed: it recomputes from then on


@dataclass
class _Layer:
    name: str
    cache: torch.Tensor  # blocks first: [num_blocks, heads, tokens, content]
    page_bytes: int
    block_stride: int  # bytes between two blocks of this layer
    offset: int  # of this layer's page inside one object


class KvpoolConnector(KVConnectorBase_V1):
    """vLLM's KV connector on kvpool: prefix blocks are looked up, loaded and saved by vLLM's
    block hash. See the module docstring; ``kv_connector_extra_config`` keys: ``DEFAULTS``."""

    _cache_hit_source = CacheHitSource.HOST  # kvpool is a pool of host memory

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(DEFAULTS)
        extra.update(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = extra
        self._error_logged = False
        self._lock = threading.Lock()
        self.load_async = bool(extra["load_async"])
        self.block_size = vllm_config.cache_config.block_size
        self.enabled = True
        spec = self._spec()
        if spec is None:
            self.enabled = False
        algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
        if algo in _NON_REPRODUCIBLE_HASHES and os.getenv("PYTHONHASHSEED") is None:
            log.warning(
                "kvpool: vLLM's prefix hash %s is seeded at random per process without "
                "PYTHONHASHSEED, so its block hashes can't be shared; kvpool will neither "
                "look up nor store KV blocks (set PYTHONHASHSEED or use sha256)",
                algo,
            )
            self.enabled = False
        par = vllm_config.parallel_config
        self.tp_size = int(getattr(par, "tensor_parallel_size", 1))
        self.pp_size = int(getattr(par, "pipeline_parallel_size", 1))
        self.store = EngineStore(
            str(extra["kvpool_url"]),
            extra["namespace"],
            extra["token"],
            lookup_timeout=float(extra["lookup_timeout"]),
            io_timeout=float(extra["io_timeout"]),
            failure_threshold=int(extra["failure_threshold"]),
            probe_interval=float(extra["probe_interval"]),
            same_host=bool(extra["same_host"]),
            name="kvpool (vLLM)",
        )
        self._last_stats = self.store.stats()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ----- shared -----

    def _spec(self) -> Any:
        """The KV cache spec of the one cache group, or None (logged) when there are several
        (hybrid KV cache manager on, which this connector does not declare support for)."""
        kcc = self._kv_cache_config
        if kcc is None or len(kcc.kv_cache_groups) != 1:
            log.warning(
                "kvpool: %s KV cache groups; the connector handles exactly one (HMA off) "
                "and stays idle",
                0 if kcc is None else len(kcc.kv_cache_groups),
            )
            return None
        return kcc.kv_cache_groups[0].kv_cache_spec

    def salt(self, tp_rank: int, pp_rank: int) -> str:
        """The key prefix of one rank's objects (see the module docstring)."""
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        mc = self._vllm_config.model_config
        par = self._vllm_config.parallel_config
        model = self.config["model_id"] or (mc.model if mc is not None else "")
        num_layers = (
            mc.get_total_num_hidden_layers()
            if mc is not None and hasattr(mc, "get_total_num_hidden_layers")
            else len(self._kv_cache_config.kv_cache_groups[0].layer_names)
        )
        return layout_salt(
            engine="vllm",
            model=str(model),
            revision=str(getattr(mc, "revision", None)),
            quantization=str(getattr(mc, "quantization", None)),
            dtype=str(getattr(spec, "dtype", "")),
            kv_quant=str(getattr(spec, "kv_quant_mode", "")),
            block_size=self.block_size,
            tp_size=self.tp_size,
            tp_rank=tp_rank,
            pp_size=self.pp_size,
            pp_rank=pp_rank,
            dcp_size=int(getattr(par, "decode_context_parallel_size", 1) or 1),
            pcp_size=int(getattr(par, "prefill_context_parallel_size", 1) or 1),
            num_layers=num_layers,
            num_kv_heads=getattr(spec, "num_kv_heads", None),
            head_size=getattr(spec, "head_size", None),
            head_size_v=getattr(spec, "head_size_v", None),
            kv_layout=f"{type(spec).__name__}:page[heads,tokens,content]",
            page_bytes=_page_bytes(spec),
        )

    def _note_error(self, where: str, e: BaseException) -> None:
        self.store.counters.add(errors=1)
        if not self._error_logged:
            self._error_logged = True
            log.warning("kvpool connector: %s failed (%r); treated as a miss", where, e)
        else:
            log.debug("kvpool connector: %s failed (%r)", where, e)

    def _stats_delta(self) -> KvpoolConnectorStats | None:
        now = self.store.stats()
        prev, self._last_stats = self._last_stats, now
        data: dict[str, Any] = {}
        for k in _STORE_FIELDS:
            data[k] = now[k] - prev.get(k, 0)
        lat, plat = now["load_latency"], prev["load_latency"]
        data["load_count"] = sum(lat["counts"]) - sum(plat["counts"])
        data["load_seconds"] = lat["sum"] - plat["sum"]
        with self._lock:
            data["load_failed_blocks"] = self._failed_total - self._failed_reported
            data["save_dropped_blocks"] = self._dropped_total - self._dropped_reported
            self._failed_reported = self._failed_total
            self._dropped_reported = self._dropped_total
        stats = KvpoolConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @_guarded(lambda: None)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's counters since the last call (scheduler: lookups; worker: loads,
        saves, bytes, load latency), or None when nothing happened."""
        return self._stats_delta()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvpoolConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvpoolPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, nothing more

    # ----- scheduler side -----

    def _init_scheduler(self) -> None:
        kvt = self._kv_transfer_config
        if (
            not self.config["keep_failure_policy"]
            and kvt.kv_load_failure_policy != "recompute"
        ):
            # vLLM's default policy fails a request whose KV load failed; for a cache a failed
            # load is a miss. The scheduler reads the policy after building this connector.
            kvt.kv_load_failure_policy = "recompute"
            log.info(
                "kvpool: kv_load_failure_policy set to 'recompute' (a failed load is a miss)"
            )
        self._reqs: dict[str, _Tracked] = {}
        # req -> first block asked from -> leading blocks stored for every rank
        self._matches: dict[str, dict[int, int]] = {}
        # req -> vLLM's local hit (tokens) at its last lookup: where its load starts
        self._asked: dict[str, int] = {}
        self._pending_loads: list[BlockJob] = []
        self._loading: dict[str, _Tracked] = {}  # requests with a load not yet reported
        self._failed_total = self._failed_reported = 0
        self._dropped_total = self._dropped_reported = 0
        self._rank_salts: list[str] = []
        if self.enabled:
            self._rank_salts = [
                self.salt(tp, pp)
                for pp in range(self.pp_size)
                for tp in range(self.tp_size)
            ]

    def _matched_blocks(self, request: Request, first: int) -> int:
        """Leading blocks of ``request`` stored for every rank, asking kvpool once (one
        ``match_prefix``, one round trip per node) per request and starting block."""
        seen = self._matches.setdefault(request.request_id, {})
        hit = seen.get(first)
        if hit is not None:
            return hit
        hashes = request.block_hashes[first:]
        n = len(self._rank_salts)
        keys = [f"{s}@{h.hex()}" for h in hashes for s in self._rank_salts]
        hit = first + self.store.match_prefix(keys) // n if keys else first
        seen[first] = hit
        return hit

    @_guarded(lambda: (0, False))
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvpool holds beyond vLLM's own ``num_computed_tokens`` (whole blocks; one
        block less when the hit covers the whole prompt, so one token is computed)."""
        if not self.enabled or not request.block_hashes:
            return 0, False
        tr = self._reqs.get(request.request_id)
        if tr is not None and tr.no_load:
            return 0, False
        first = num_computed_tokens // self.block_size
        hit = self._matched_blocks(request, first)
        self._asked[request.request_id] = first * self.block_size
        tokens = hit * self.block_size
        if tokens >= request.num_tokens:
            tokens = (request.num_tokens - 1) // self.block_size * self.block_size
        n = tokens - num_computed_tokens
        if n <= 0:
            return 0, False
        return n, self.load_async

    @_guarded(lambda: None)
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remembers the request's blocks; with ``num_external_tokens`` it plans their load."""
        if not self.enabled:
            return
        rid = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        tr = self._reqs.get(rid)
        if tr is None:
            tr = self._reqs[rid] = _Tracked(request)
        if block_ids:
            tr.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        # The load starts where vLLM's block-aligned local hit ended (the value it passed to
        # get_num_new_matched_tokens); a load is whole blocks, rounded up.
        local = self._asked.get(rid, 0)
        first = local // self.block_size
        last = first + -(-num_external_tokens // self.block_size)
        ids = tr.block_ids[first:last]
        hashes = [h.hex() for h in request.block_hashes[first:last]]
        if len(ids) != last - first or len(hashes) != len(ids):
            log.debug("kvpool: %s: no blocks %d..%d to load into", rid, first, last)
            return
        tr.stored = max(tr.stored, self._matches.get(rid, {}).get(first, last))
        job = BlockJob(rid, ids, hashes)
        tr.load, tr.load_first = job, first
        self._loading[rid] = tr
        self._pending_loads.append(job)

    @_guarded(lambda: KvpoolConnectorMetadata())
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        """This step's loads (planned in ``update_state_after_alloc``) and the saves of the
        blocks that become full in this step and are not stored yet."""
        meta = KvpoolConnectorMetadata(load_async=self.load_async)
        meta.loads, self._pending_loads = self._pending_loads, []
        if not self.enabled:
            return meta
        sched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            tr = self._reqs.get(nr.req_id)
            if tr is None:
                continue
            tr.block_ids = list(nr.block_ids[0])
            self._forget_matches(nr.req_id)  # a preempted request asks afresh
            self._plan_save(meta, tr, nr.num_computed_tokens + sched.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._reqs.get(rid)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids else []
                self._forget_matches(rid)
            elif new_ids:
                tr.block_ids.extend(new_ids[0])
            self._plan_save(meta, tr, cached.num_computed_tokens[i] + sched.get(rid, 0))
        return meta

    @_guarded(lambda: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learns which loads finished and which blocks failed. A request whose load had a
        failed block is not offered kvpool blocks again (vLLM recomputes it; a daemon that
        keeps failing must not loop it through loads), and its failed blocks will be saved
        again once recomputed."""
        bad = connector_output.invalid_block_ids or set()
        done = connector_output.finished_recving or set()
        for rid, tr in list(self._loading.items()):
            job = tr.load
            if job is None:
                del self._loading[rid]
                continue
            failed = [i for i, b in enumerate(job.block_ids) if b in bad]
            if failed:
                tr.no_load = True
                tr.stored = min(tr.stored, tr.load_first + failed[0])
            if failed or job.req_id in done or not self.load_async:
                tr.load = None  # a synchronous load reports its errors in its own step
                del self._loading[rid]

    def _plan_save(
        self, meta: KvpoolConnectorMetadata, tr: _Tracked, computed: int
    ) -> None:
        hashes = tr.request.block_hashes
        full = min(computed // self.block_size, len(hashes), len(tr.block_ids))
        if full <= tr.stored:
            return
        rid = tr.request.request_id
        ids = tr.block_ids[tr.stored : full]
        meta.saves.append(
            BlockJob(rid, ids, [h.hex() for h in hashes[tr.stored : full]])
        )
        tr.stored = full

    @_guarded(lambda: (False, None))
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request. Never holds its blocks: saves copied them into staging in
        ``wait_for_save`` of the step that computed them, before vLLM could free them."""
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._loading.pop(rid, None)
        self._asked.pop(rid, None)
        self._forget_matches(rid)
        return False, None

    def _forget_matches(self, rid: str) -> None:
        self._matches.pop(rid, None)

    # ----- worker side -----

    def _init_worker(self) -> None:
        self._layers: list[_Layer] = []
        self._obj_bytes = 0
        self._salt = ""
        self._staging: torch.Tensor | None = None
        # Host-memory caches whose pages are registered with the store: loads go straight
        # into the pages (no staging copy); the registered regions, to unregister.
        self._direct: list[int] = []
        self._free_slots: list[int] = []
        self._slots_cv = threading.Condition()
        self._jobs: queue.Queue[tuple[BlockJob, bool, threading.Event] | None] = (
            queue.Queue()
        )
        self._saves: queue.Queue[tuple[list[str], list[int]] | None] = queue.Queue()
        self._failed_blocks: set[int] = set()
        self._failed_total = self._failed_reported = 0
        self._dropped_total = self._dropped_reported = 0
        self._done_recving: set[str] = set()
        self._sync_pending: list[threading.Event] = []
        # Requests whose synchronous load failed in this step: their saves of this step are
        # skipped, since the forward computed them over blocks that were never loaded.
        self._sync_failed: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._ranks = self._worker_ranks()

    def _worker_ranks(self) -> tuple[int, int]:
        tp = self.config.get("tp_rank")
        pp = self.config.get("pp_rank")
        if tp is None or pp is None:
            try:
                from vllm.distributed.parallel_state import get_pp_group, get_tp_group

                tp = get_tp_group().rank_in_group if tp is None else tp
                pp = get_pp_group().rank_in_group if pp is None else pp
            except Exception:  # noqa: BLE001 (no process groups: a single rank)
                tp = 0 if tp is None else tp
                pp = 0 if pp is None else pp
        return int(tp), int(pp)

    @_guarded(lambda: None)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes vLLM's per-layer KV tensors (each a view ``[num_blocks, heads, tokens,
        content]`` of its cache allocation), computes each layer's block stride and page size,
        allocates and registers the host staging buffer and starts the loader and saver."""
        if not self.enabled:
            return
        kcc = self._kv_cache_config
        num_blocks = kcc.num_blocks
        names = [n for n in kcc.kv_cache_groups[0].layer_names if n in kv_caches]
        seen: set[tuple[int, tuple[int, ...]]] = set()
        offset = 0
        layers: list[_Layer] = []
        for name in names:
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                raise ValueError(f"layer {name}: not a paged KV tensor")
            if t.shape[0] != num_blocks:  # kernel blocks: view manager blocks as dim 0
                if t.shape[0] % num_blocks:
                    raise ValueError(
                        f"layer {name}: {t.shape[0]} blocks for {num_blocks}"
                    )
                t = t.unflatten(0, (num_blocks, -1))
            ident = (t.data_ptr(), tuple(t.shape))
            if ident in seen:  # a layer that shares another's cache (KV sharing)
                continue
            seen.add(ident)
            page = t[0].numel() * t.element_size()
            layers.append(_Layer(name, t, page, t.stride(0) * t.element_size(), offset))
            offset += page
        if not layers:
            raise ValueError("no KV cache layers to register")
        spec = kcc.kv_cache_groups[0].kv_cache_spec
        if any(lay.page_bytes != _page_bytes(spec) for lay in layers):
            raise ValueError(
                f"page of {layers[0].page_bytes} bytes, spec says {_page_bytes(spec)}"
            )
        self._layers = layers
        self._obj_bytes = offset
        self._salt = self.salt(*self._ranks)
        slots = max(2, int(self.config["staging_blocks"]))
        pin = torch.cuda.is_available()
        self._staging = torch.empty((slots, offset), dtype=torch.uint8, pin_memory=pin)
        self._free_slots = list(range(slots))
        self.store.register(self._staging.data_ptr(), slots * offset)
        self._device = layers[0].cache.device
        if self._device.type == "cpu" and all(
            lay.cache[0].is_contiguous() for lay in layers
        ):
            regions = {
                lay.cache.data_ptr(): (num_blocks - 1) * lay.block_stride
                + lay.page_bytes
                for lay in layers
            }
            for ptr, size in regions.items():
                self.store.register(ptr, size)
            self._direct = list(regions)
        for target, name in ((self._load_loop, "loader"), (self._save_loop, "saver")):
            th = threading.Thread(
                target=target, name=f"kvpool-vllm-{name}", daemon=True
            )
            th.start()
            self._threads.append(th)
        log.info(
            "kvpool: %d layers, %d bytes per block object, %d staging slots, salt %s "
            "(tp %d/%d, pp %d/%d)",
            len(layers),
            offset,
            slots,
            self._salt,
            self._ranks[0],
            self.tp_size,
            self._ranks[1],
            self.pp_size,
        )

    @property
    def block_strides(self) -> dict[str, int]:
        """Per layer, the bytes between two consecutive blocks in vLLM's cache."""
        return {lay.name: lay.block_stride for lay in self._layers}

    @property
    def object_bytes(self) -> int:
        """Size of one stored object: one block of every layer of this rank."""
        return self._obj_bytes

    def key(self, block_hash_hex: str) -> str:
        """This worker's key of a block."""
        return f"{self._salt}@{block_hash_hex}"

    # slots of the staging buffer

    def _take_slots(self, n: int, timeout: float | None) -> list[int]:
        """Up to ``n`` free staging slots (at least one unless the wait timed out)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._slots_cv:
            while not self._free_slots:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._slots_cv.wait(left)
            got, self._free_slots = self._free_slots[:n], self._free_slots[n:]
            return got

    def _give_slots(self, slots: Iterable[int]) -> None:
        with self._slots_cv:
            self._free_slots.extend(slots)
            self._slots_cv.notify_all()

    def _slot_ptr(self, slot: int) -> int:
        assert self._staging is not None
        return self._staging.data_ptr() + slot * self._obj_bytes

    def _host_pages(self, block_ids: list[int]) -> bool:
        """Whether the cache is in host memory with each block's page of a layer contiguous,
        so that a page is one ``memmove``; raises IndexError for a block id out of range."""
        if self._device.type != "cpu" or not all(
            lay.cache[0].is_contiguous() for lay in self._layers
        ):
            return False
        num_blocks = self._layers[0].cache.shape[0]
        if any(not 0 <= b < num_blocks for b in block_ids):
            raise IndexError(f"a block id outside 0..{num_blocks}")
        return True

    def _gather(self, block_ids: list[int], slots: list[int]) -> None:
        """Copies the blocks (every layer) into the staging slots. It runs on the step's
        stream after the forward, and ``.cpu()`` waits for the device copy. A host-memory cache
        takes one ``memmove`` per page and layer (torch's byte-wise indexed assignment into
        the slots took 2.2 s per 512 MiB on one core, the memmoves 0.06 s)."""
        assert self._staging is not None
        if self._host_pages(block_ids):  # see _scatter
            dsts = [self._slot_ptr(s) for s in slots]
            for lay in self._layers:
                base, stride, size = (
                    lay.cache.data_ptr(),
                    lay.block_stride,
                    lay.page_bytes,
                )
                for b, dst_ptr in zip(block_ids, dsts):
                    _memmove(dst_ptr + lay.offset, base + b * stride, size)
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        dst = torch.tensor(slots, dtype=torch.long)
        for lay in self._layers:
            pages = lay.cache.index_select(0, idx).contiguous()
            flat = pages.view(torch.uint8).reshape(len(block_ids), lay.page_bytes)
            self._staging[dst, lay.offset : lay.offset + lay.page_bytes] = flat.cpu()

    def _scatter(self, block_ids: list[int], slots: list[int]) -> None:
        """Copies the staging slots into the blocks (every layer). A cache in host memory
        whose pages are contiguous takes one ``memmove`` per page and layer: torch's
        byte-wise gather of the slots (``staging[slots, range]``) and ``index_copy_`` move
        512 MiB in about 0.6 s on one core, the memmoves in 0.06-0.09 s."""
        assert self._staging is not None
        if self._host_pages(block_ids):
            srcs = [self._slot_ptr(s) for s in slots]
            for lay in self._layers:
                base, stride, size = (
                    lay.cache.data_ptr(),
                    lay.block_stride,
                    lay.page_bytes,
                )
                for b, src in zip(block_ids, srcs):
                    _memmove(base + b * stride, src + lay.offset, size)
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        src = torch.tensor(slots, dtype=torch.long)
        for lay in self._layers:
            raw = self._staging[src, lay.offset : lay.offset + lay.page_bytes]
            pages = raw.to(self._device).view(lay.cache.dtype)
            lay.cache.index_copy_(
                0, idx, pages.reshape(len(block_ids), *lay.cache.shape[1:])
            )
        if self._device.type == "cuda":
            # Device copies are queued, not done: the load is reported finished only once
            # they are, since the request's forward may run on another stream.
            torch.cuda.current_stream(self._device).synchronize()

    # loads

    @_guarded(lambda: None)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Hands this step's loads to the loader thread. Asynchronous loads (the default)
        return at once: vLLM calls this after launching the forward, and the requests wait
        for ``get_finished``. Synchronous loads (``load_async: false``; vLLM calls this before
        the forward) are waited for here, since one object holds every layer of a block:
        waiting in ``wait_for_layer_load`` instead would gain no overlap and would be skipped
        inside CUDA-graph replay."""
        meta = self._connector_metadata
        if not isinstance(meta, KvpoolConnectorMetadata) or not meta.loads:
            return
        for job in meta.loads:
            if self._staging is None:  # registration failed: every block is recomputed
                self._load_failed(job, job.block_ids, meta.load_async)
                if meta.load_async:
                    with self._lock:
                        self._done_recving.add(job.req_id)
                continue
            done = threading.Event()
            if not meta.load_async:
                self._sync_pending.append(done)
            self._jobs.put((job, meta.load_async, done))
        self._wait_sync_loads()

    @_guarded(lambda: None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing left to wait for: synchronous loads completed in ``start_load_kv``, and
        asynchronous ones belong to requests that are not in this forward."""
        self._wait_sync_loads()

    def _wait_sync_loads(self) -> None:
        pending, self._sync_pending = self._sync_pending, []
        for ev in pending:
            ev.wait()

    def _load_failed(self, job: BlockJob, block_ids: list[int], is_async: bool) -> None:
        with self._lock:
            if not is_async:
                self._sync_failed.add(job.req_id)
            self._failed_blocks.update(block_ids)
            self._failed_total += len(block_ids)

    def _load(self, job: BlockJob, is_async: bool) -> None:
        batch = max(1, int(self.config["batch_blocks"]))
        # Straight into a host-memory cache's pages: copied from kvpoold's memory on its host,
        # received from the socket into them elsewhere; no staging slot, no scatter.
        if self._direct and self._host_pages(job.block_ids):
            self._load_direct(job, is_async, batch)
            return
        i = 0
        while i < len(job.block_ids):
            slots = self._take_slots(min(batch, len(job.block_ids) - i), None)
            ids = job.block_ids[i : i + len(slots)]
            keys = [self.key(h) for h in job.hashes[i : i + len(slots)]]
            i += len(slots)
            try:
                ok = self.store.load(
                    keys,
                    [self._slot_ptr(s) for s in slots],
                    [self._obj_bytes] * len(slots),
                )
                good = [(b, s) for b, s, o in zip(ids, slots, ok) if o]
                if good:
                    self._scatter([b for b, _ in good], [s for _, s in good])
                bad = [b for b, o in zip(ids, ok) if not o]
            except Exception as e:  # noqa: BLE001 (a failed load is a recompute)
                self._note_error("load", e)
                bad = ids
            finally:
                self._give_slots(slots)
            if bad:
                self._load_failed(job, bad, is_async)

    def _load_direct(self, job: BlockJob, is_async: bool, batch: int) -> None:
        """Loads straight into a host-memory cache's registered pages: each block's object goes
        into its 32 (or however many) layer pages in one verified pass (copied from kvpoold's
        memory, or received from the socket), with no staging copy and no scatter. A block that fails may be left half-written; it is reported in
        ``get_block_ids_with_load_errors`` and vLLM recomputes it over those bytes."""
        for i in range(0, len(job.block_ids), batch):
            ids = job.block_ids[i : i + batch]
            keys = [self.key(h) for h in job.hashes[i : i + batch]]
            pieces = [
                [
                    (lay.cache.data_ptr() + b * lay.block_stride, lay.page_bytes)
                    for lay in self._layers
                ]
                for b in ids
            ]
            try:
                ok = self.store.load_scattered(keys, pieces)
                bad = [b for b, o in zip(ids, ok) if not o]
            except Exception as e:  # noqa: BLE001 (a failed load is a recompute)
                self._note_error("load", e)
                bad = ids
            if bad:
                self._load_failed(job, bad, is_async)

    def _load_loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, is_async, done = item
            try:
                self._load(job, is_async)
            except Exception as e:  # noqa: BLE001
                self._note_error("load", e)
                self._load_failed(job, job.block_ids, is_async)
            finally:
                if is_async:  # failed blocks were recorded first (see get_finished)
                    with self._lock:
                        self._done_recving.add(job.req_id)
                done.set()

    # saves

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: one object holds every layer of a block, gathered in
        ``wait_for_save`` once the forward has written them all."""
        return

    @_guarded(lambda: None)
    def wait_for_save(self) -> None:
        """Copies the blocks that became full this step into staging (before returning, so
        vLLM may free or reuse them afterwards) and hands them to the saver thread. A save
        that finds no free staging slot within ``io_timeout`` is dropped (a future miss).
        A request whose synchronous load failed this step saves nothing this step: its new
        blocks were computed over blocks that never arrived (the scheduler saves them again
        once vLLM has recomputed them)."""
        self._wait_sync_loads()
        with self._lock:
            skip, self._sync_failed = self._sync_failed, set()
        meta = self._connector_metadata
        if not isinstance(meta, KvpoolConnectorMetadata) or self._staging is None:
            return
        timeout = float(self.config["io_timeout"])
        batch = max(1, int(self.config["batch_blocks"]))
        for job in meta.saves:
            if job.req_id in skip:
                continue
            i = 0
            while i < len(job.block_ids):
                slots = self._take_slots(min(batch, len(job.block_ids) - i), timeout)
                if not slots:
                    with self._lock:
                        self._dropped_total += len(job.block_ids) - i
                    break
                ids = job.block_ids[i : i + len(slots)]
                keys = [self.key(h) for h in job.hashes[i : i + len(slots)]]
                i += len(slots)
                try:
                    self._gather(ids, slots)
                except Exception:
                    self._give_slots(slots)
                    raise
                self._saves.put((keys, slots))

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            keys, slots = item
            try:
                self.store.save(
                    keys,
                    [self._slot_ptr(s) for s in slots],
                    [self._obj_bytes] * len(slots),
                )
            except Exception as e:  # noqa: BLE001 (a failed save is a future miss)
                self._note_error("save", e)
            finally:
                self._give_slots(slots)

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until every queued load and save has finished; whether they did in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._slots_cv:
                idle = (
                    self._staging is None
                    or len(self._free_slots) == self._staging.shape[0]
                )
            if idle and self._jobs.empty() and self._saves.empty():
                return True
            time.sleep(0.005)
        return False

    # completions

    @_guarded(lambda: (None, None))
    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """(None, requests whose asynchronous loads completed since the last call). Saves never
        hold a request's blocks, so nothing is ever reported as sending. A load with failed
        blocks is reported here too; its failed blocks are already in
        ``get_block_ids_with_load_errors``, which vLLM asks right after, so it recomputes
        exactly those (and what follows them) and keeps the blocks that did load."""
        with self._lock:
            done, self._done_recving = self._done_recving, set()
        return None, done or None

    @_guarded(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Exactly the blocks whose load failed since the last call; vLLM recomputes them."""
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    @_guarded(lambda: None)
    def shutdown(self) -> None:
        """Finishes queued work (bounded by ``io_timeout``), stops the threads and closes the
        client."""
        if self._role == KVConnectorRole.WORKER and self._threads:
            self.flush(float(self.config["io_timeout"]) + 1.0)
            self._jobs.put(None)
            self._saves.put(None)
            for th in self._threads:
                th.join(timeout=float(self.config["io_timeout"]) + 1.0)
            self._threads = []
            if self._staging is not None:
                self.store.unregister(self._staging.data_ptr())
            for ptr in self._direct:
                self.store.unregister(ptr)
        self.store.close()

"""kvpool as vLLM's KV cache store: a v1 KV connector for vllm 0.33.

Loaded by vLLM's connector factory with no code change in vLLM::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvpoolConnector",
        "kv_connector_module_path":"kvpool.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"kvpool_url":"tcp://127.0.0.1:7070"}}'

vLLM builds one :class:`KvpoolConnector` in its scheduler process and one in every worker
process (each tensor- and pipeline-parallel rank). They share no memory: the scheduler decides
what to load and save and sends it to the workers in :class:`KvpoolConnectorMetadata`; the
workers move the bytes and report back through vLLM's connector output.

**Keys.** One object per (block, KV cache group, group of ``heads_per_object`` KV heads):
``"{salt}@{block_hash.hex()}"``, where ``block_hash`` is vLLM's own prefix-caching hash of the
block (``request.block_hashes``: full blocks only, chained from the first token, including LoRA,
multimodal and ``cache_salt`` extra keys) and ``salt`` is :func:`kvpool.engine.layout_salt` of
the model, the cache dtype, the block size, the pipeline stage, the layer and head geometry, the
cache group (its index and kind: full attention, MLA or sliding window) and the model-wide index
of the object's first head with ``heads_per_object``. It names no tensor-parallel size or rank:
instances that set the same ``heads_per_object`` (default: a rank's heads, one object per block
and rank) share objects whatever their TP sizes (prefill at TP 2, decode at TP 1, or the
reverse), each rank loading the objects of its heads, one round trip per batch of blocks. Every
object is written once: by the lowest rank holding its heads, so an MLA latent (one "head",
equal on every rank) is written by rank 0 alone and loaded by every rank. A partial last block
has no hash and is never stored. With a non-cryptographic prefix hash (``xxhash``/
``xxhash_cbor``) and no ``PYTHONHASHSEED``, vLLM seeds its hashes at random per process, so no
other process could ever reuse them: the connector then neither looks up nor stores (one
warning).

**Values.** The concatenation, over the group's layers in model order, of the heads' slice of
each layer's page for that block in vLLM's logical ``[heads, tokens, content]`` order (its K
and V). It is gathered from the paged KV cache into a registered host staging buffer (the copy
a GPU deployment makes into pinned memory anyway) and written with one ``EngineStore.save`` per
batch; loads go the other way, except into a host-memory cache, whose registered pages each
object is loaded into directly (``EngineStore.load_scattered``: copied from kvpoold's memory on
its host, received from the socket elsewhere).

**Asynchrony.** Loads run on a loader thread. By default (``load_async``) the scheduler parks the
request in ``WAITING_FOR_REMOTE_KVS`` while other requests compute, and the worker reports it in
``finished_recving`` when its blocks are in place; with ``load_async: false`` the request is
scheduled at once and ``start_load_kv`` (called before the forward) waits for its load. Saves
gather the new full blocks into staging
inside ``wait_for_save`` (so the source blocks are never read after vLLM may free or reuse them,
and ``request_finished`` never needs to hold blocks) and a saver thread writes them to kvpool
while the next steps compute. Any failure is a miss: a block that fails to load is returned by
``get_block_ids_with_load_errors`` and vLLM recomputes it (with several KV cache groups, whose
block ids vLLM cannot map back, its request is reported in ``failed_recving`` and recomputed;
loads are then always asynchronous); a save that fails is a future miss.

**HMA.** The class declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on.
Full-attention, MLA and sliding-window groups are stored per group, each from its own block
ids; a hit needs every group whole where vLLM reads it (a sliding window only inside the
window of the hit's boundary). Mamba states (vLLM's ``align`` cache mode, which prefix caching
turns on) are saved from the boundary states vLLM's KV cache manager offers each step
(``SchedulerOutput.kv_connector_block_state``), each under the hash of the block ending at its
boundary; a hit needs the state at its boundary, loaded into the block vLLM allocates there. A
group the connector does not store (a Mamba state without prefix caching, chunked local or
cross attention) leaves it idle: the model runs, without kvpool. See docs/ENGINES.md.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ._vllm_meta import (
    BlockJob,
    GroupLayout,
    KvpoolConnectorMetadata,
    group_layout,
    guarded,
    log,
    page_bytes,
)
from ._vllm_scheduler import SchedulerSide
from ._vllm_stats import STORE_FIELDS, KvpoolConnectorStats, KvpoolPromMetrics
from ._vllm_worker import WorkerSide
from .engine import EngineStore, layout_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "DEFAULTS",
    "BlockJob",
    "GroupLayout",
    "KvpoolConnector",
    "KvpoolConnectorMetadata",
    "KvpoolConnectorStats",
    "KvpoolPromMetrics",
]

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
    "heads_per_object": None,
}

_NON_REPRODUCIBLE_HASHES = ("xxhash", "xxhash_cbor")


class KvpoolConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector on kvpool: prefix blocks are looked up, loaded and saved by vLLM's
    block hash. See the module docstring; ``kv_connector_extra_config`` keys: ``DEFAULTS``.
    The scheduler's methods are in ``SchedulerSide``, the workers' in ``WorkerSide``."""

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
        par = vllm_config.parallel_config
        self.tp_size = int(getattr(par, "tensor_parallel_size", 1))
        self.pp_size = int(getattr(par, "pipeline_parallel_size", 1))
        self.enabled = True
        layouts = self._group_layouts()
        self.layouts: list[GroupLayout] = layouts or []
        if layouts is None:
            self.enabled = False
        elif self.per_request_failures and not self.load_async:
            # With several groups vLLM takes a failed load per request (failed_recving),
            # which it can only honour for a request that waits for its load.
            log.warning(
                "kvpool: %d KV cache groups (or a Mamba state): load_async is required "
                "and turned on",
                len(self._kv_cache_config.kv_cache_groups),
            )
            self.load_async = True
        algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
        if algo in _NON_REPRODUCIBLE_HASHES and os.getenv("PYTHONHASHSEED") is None:
            log.warning(
                "kvpool: vLLM's prefix hash %s is seeded at random per process without "
                "PYTHONHASHSEED, so its block hashes can't be shared; kvpool will neither "
                "look up nor store KV blocks (set PYTHONHASHSEED or use sha256)",
                algo,
            )
            self.enabled = False
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

    @property
    def per_request_failures(self) -> bool:
        """Whether a failed load is reported per request (``failed_recving``, recomputed
        from the first token) rather than as block ids: with several KV cache groups, whose
        block ids vLLM cannot map back to requests, or a Mamba state, which is no block
        vLLM could recompute on its own."""
        kcc = self._kv_cache_config
        groups = len(kcc.kv_cache_groups) if kcc is not None else 0
        return groups > 1 or any(lay.is_state for lay in self.layouts)

    def _group_layouts(self) -> list[GroupLayout] | None:
        """How each KV cache group is stored, or None (logged) when a group holds something
        the connector does not store (a Mamba state outside the ``align`` cache mode,
        chunked local or cross attention, a block size other than the hashes'): it then
        stays idle, since a hit must restore every group."""
        kcc = self._kv_cache_config
        if kcc is None or not kcc.kv_cache_groups:
            log.warning("kvpool: no KV cache groups; the connector stays idle")
            return None
        par = self._vllm_config.parallel_config
        cp = [
            int(getattr(par, f"{kind}_context_parallel_size", 1) or 1)
            for kind in ("decode", "prefill")
        ]
        if max(cp) > 1:
            # Its ranks hold other tokens of the blocks (under one TP rank, or as one of
            # the ranks vLLM takes for a shared head), and its blocks span more tokens.
            log.warning(
                "kvpool: context parallelism (DCP %d, PCP %d) is not supported; the "
                "connector stays idle",
                *cp,
            )
            return None
        mc = self._vllm_config.model_config
        model_heads = None
        if mc is not None and hasattr(mc, "get_total_num_kv_heads"):
            model_heads = int(mc.get_total_num_kv_heads())
        out = []
        per_object = self.config["heads_per_object"]
        for i, group in enumerate(kcc.kv_cache_groups):
            if not getattr(group, "enable_kv_transfer", True):
                continue  # a replica vLLM rebuilds from its source group after a load
            spec = group.kv_cache_spec
            try:
                layout = group_layout(
                    i, spec, model_heads, self.tp_size, per_object and int(per_object)
                )
            except ValueError as e:
                log.warning(
                    "kvpool: KV cache group %d: %s; the connector stays idle", i, e
                )
                return None
            if layout is None or spec.block_size != self.block_size:
                log.warning(
                    "kvpool: KV cache group %d (%s, %d-token blocks) is not one the "
                    "connector stores; it stays idle",
                    i,
                    type(spec).__name__,
                    spec.block_size,
                )
                return None
            out.append(layout)
        return out or None

    def object_salt(self, layout: GroupLayout, head: int, pp_rank: int) -> str:
        """The key prefix of the objects of the group's KV heads that start at ``head``
        (model-wide index) in pipeline stage ``pp_rank``. It names no tensor-parallel size or
        rank: a reader with another TP layout and the same ``heads_per_object`` finds the
        heads it holds under the same keys."""
        spec = layout.spec
        mc = self._vllm_config.model_config
        par = self._vllm_config.parallel_config
        group = self._kv_cache_config.kv_cache_groups[layout.index]
        model = self.config["model_id"] or (mc.model if mc is not None else "")
        num_layers = (
            mc.get_total_num_hidden_layers()
            if mc is not None and hasattr(mc, "get_total_num_hidden_layers")
            else len(group.layer_names)
        )
        fields: dict[str, Any] = {}
        if layout.is_state:
            # A state's bytes: its tensors' shapes and dtypes, and the kernel family
            # that writes them.
            fields["state"] = (
                f"{tuple(spec.shapes)}:{tuple(str(d) for d in spec.dtypes)}:"
                f"{getattr(spec, 'mamba_type', '')}"
            )
        return layout_salt(
            **fields,
            engine="vllm",
            model=str(model),
            revision=str(getattr(mc, "revision", None)),
            quantization=str(getattr(mc, "quantization", None)),
            dtype=str(getattr(spec, "dtype", "")),
            kv_quant=str(getattr(spec, "kv_quant_mode", "")),
            block_size=self.block_size,
            pp_size=self.pp_size,
            pp_rank=pp_rank,
            dcp_size=int(getattr(par, "decode_context_parallel_size", 1) or 1),
            pcp_size=int(getattr(par, "prefill_context_parallel_size", 1) or 1),
            num_layers=num_layers,
            group=layout.index,
            group_layers=len(group.layer_names),
            kind=layout.kind,
            window=getattr(spec, "sliding_window", None),
            total_kv_heads=layout.total_heads,
            head=head,
            heads_per_object=layout.heads_per_object,
            head_size=getattr(spec, "head_size", None),
            head_size_v=getattr(spec, "head_size_v", None),
            head_bytes=page_bytes(spec) // layout.heads_per_rank,
            kv_layout=f"{type(spec).__name__}:head[tokens,content]",
        )

    def salt(self, tp_rank: int, pp_rank: int) -> str:
        """The key prefix of the first object a rank holds of a block (first group, its first
        KV heads); ``object_salt`` gives every object's."""
        layout = self.layouts[0]
        return self.object_salt(
            layout, layout.rank_heads(self.tp_size, tp_rank)[0], pp_rank
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
        for k in STORE_FIELDS:
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

    @guarded(lambda: None)
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

    @guarded(lambda: None)
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

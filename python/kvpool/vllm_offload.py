"""kvpool as a secondary tier of vLLM's own ``OffloadingConnector`` (vllm 0.33).

vLLM's offloading connector keeps a CPU tier of KV chunks and, with its
``TieringOffloadingSpec``, writes every chunk stored there through to the secondary tiers listed
in ``secondary_tiers``; a chunk missing from the CPU tier is looked up in those tiers and, on a
hit, promoted back into a CPU-tier slot before the GPU load. :class:`KvpoolTier` is such a
tier, loaded by vLLM's ``SecondaryTierFactory`` from its module path, with no code change in
vLLM::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"OffloadingConnector",
        "kv_role":"kv_both","kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
        "cpu_bytes_to_use":8589934592,"secondary_tiers":[{"type":"KvpoolTier",
        "module_path":"kvpool.vllm_offload","kvpool_url":"tcp://127.0.0.1:7070"}]}}'

The tier runs in vLLM's scheduler process, next to the CPU tier's shared memory (every worker's
slot of a chunk, one row per chunk). That memory is registered with kvpool once, so a store
sends a row straight from it and a promotion loads straight into it: copied from kvpoold's
memory on its host, received from the socket into the row elsewhere.

**Keys.** One object per chunk: ``"{salt}@{block_hash.hex()}:{group}"``, the block hash and
the KV cache group index of vLLM's offload key (the hash in the shape of ``kvpool.vllm``'s keys,
so that ``kvpool.events`` announces the chunk by it), and ``salt`` is
:func:`kvpool.engine.layout_salt` of the model, the KV dtype, the hash and chunk sizes, the
cache groups, the parallel sizes, the CPU tier's row layout and ``model_id`` (see
:func:`offload_salt`). Two models or two layouts never share a key.

**Calls.** vLLM calls the tier under its manager lock and requires every call to return at
once. Lookups are asynchronous (vLLM's ``AsyncLookupManager``): a key's first lookup answers
``RETRY``, the keys of a step are looked up in one batched presence call per request on a
background thread, and the next step sees the verdict. Stores (write-through from the CPU
tier) and promotions run on a saver and a loader thread and are reported through
``get_finished_jobs``, with their bytes and time, which vLLM's back-pressure detector (the
tier config's ``backpressure``) uses to drop stores when kvpool falls behind. Nothing raises
into vLLM: a dead or slow kvpoold (``kvpool.engine.EngineStore``: short lookup deadline,
circuit breaker) is a miss, a failed store a failed job, and a chunk that fails to load is a
miss vLLM recomputes.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.core.kv_cache_utils import get_none_hash_seed
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from ._vllm_offload_io import ChunkIo
from .engine import EngineStore, layout_salt

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["DEFAULTS", "KvpoolTier", "chunk_key", "offload_salt"]

log = logging.getLogger("kvpool.vllm_offload")

#: The tier's own keys in its ``secondary_tiers`` entry, and their defaults (docs/ENGINES.md
#: repeats them). ``type``, ``module_path`` and ``backpressure`` are vLLM's.
DEFAULTS: dict[str, Any] = {
    "kvpool_url": "tcp://127.0.0.1:7070",
    "namespace": None,
    "token": None,
    "lookup_timeout": 0.05,
    "io_timeout": 2.0,
    "failure_threshold": 3,
    "probe_interval": 5.0,
    "same_host": True,
    "batch_chunks": 16,
    "model_id": None,
    "locality": None,
}


def chunk_key(salt: str, offload_key: OffloadKey) -> str:
    """kvpool's key of the chunk vLLM's ``offload_key`` names, under ``salt``: the block hash
    in hex after an ``@``, as in ``kvpool.vllm``'s keys, then ``:`` and the KV cache group."""
    block_hash = get_offload_block_hash(offload_key)
    return f"{salt}@{block_hash.hex()}:{get_offload_group_idx(offload_key)}"


def offload_salt(spec: OffloadingSpec, row_bytes: int, model_id: str | None) -> str:
    """The key prefix of one deployment's chunks: everything that changes the bytes of a row of
    the CPU tier (the model, its KV dtype, the tokens per hash and per chunk, each cache group's
    block size, layers and window, every parallel size, the bytes each worker stores per block,
    whether the layout is replicated or canonical, and the row size with its padding)."""
    cfg = spec.config
    par = cfg.parallel
    groups = [
        (
            g.group_id,
            g.tokens_per_block,
            list(g.layer_names),
            g.sliding_window_size_in_chunks,
        )
        for g in cfg.groups
    ]
    return layout_salt(
        engine="vllm-offload",
        model=str(model_id or cfg.model.name),
        dtype=str(cfg.model.dtype),
        tokens_per_hash=cfg.cache.tokens_per_hash,
        blocks_per_chunk=cfg.cache.blocks_per_chunk,
        groups=groups,
        worker_kv_bytes_per_block=cfg.worker_kv_bytes_per_block,
        world_size=par.world_size,
        tp_size=par.tp_size,
        pp_size=par.pp_size,
        pcp_size=par.pcp_size,
        dcp_size=par.dcp_size,
        replicated_layout=bool(
            getattr(spec, "replicated_layout", cfg.replicated_layout)
        ),
        canonical_layout=cfg.canonical_layout,
        kv_cache_layout=str(cfg.kv_cache_layout),
        worker_page_bytes=int(getattr(spec, "cpu_page_size_per_worker", 0)),
        row_bytes=row_bytes,
    )


def _hashes_are_shareable() -> bool | None:
    """False when vLLM seeds its block hashes at random in this process (a non-cryptographic
    prefix hash without ``PYTHONHASHSEED``): no other process could ever reuse them. None
    until vLLM's engine core has seeded them (it does so after building its scheduler)."""
    from vllm.v1.core import kv_cache_utils

    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        return None
    return (
        os.getenv("PYTHONHASHSEED") is not None
        or get_none_hash_seed() == kv_cache_utils.DEFAULT_NONE_HASH_SEED
    )


class _PresenceLookups(AsyncLookupManager):
    """vLLM's asynchronous lookups, answered by one presence call per request and step."""

    def __init__(self, tier: KvpoolTier, tier_type: str):
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(
        self, keys: list[OffloadKey], req_context: ReqContext
    ) -> Iterable[bool]:
        return self._tier.store.presence([self._tier.key(k) for k in keys])


class KvpoolTier(SecondaryTierManager):
    """A secondary tier of vLLM's ``TieringOffloadingSpec`` on kvpool (module docstring).
    Settings: the tier entry's keys, ``DEFAULTS``; an unknown one is a ``ValueError``."""

    medium: ClassVar[Medium] = Medium.CPU  # kvpool holds chunks in host memory

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **settings: Any,
    ):
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector
        )
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"kvpool tier: unknown settings {unknown}")
        cfg = dict(DEFAULTS, **settings)
        for k in ("lookup_timeout", "io_timeout"):
            if float(cfg[k]) <= 0:
                raise ValueError(f"kvpool tier: {k} must be positive")
        self.settings = cfg
        self.locality = Locality(cfg["locality"]) if cfg["locality"] else None
        self._shareable: bool | None = None
        self.salt = offload_salt(
            offloading_spec, self.block_size_bytes, cfg["model_id"]
        )
        self.store = EngineStore(
            str(cfg["kvpool_url"]),
            cfg["namespace"],
            cfg["token"],
            lookup_timeout=float(cfg["lookup_timeout"]),
            io_timeout=float(cfg["io_timeout"]),
            failure_threshold=int(cfg["failure_threshold"]),
            probe_interval=float(cfg["probe_interval"]),
            same_host=bool(cfg["same_host"]),
            name="kvpool (vLLM offloading tier)",
        )
        view = primary_kv_view
        self._base = (
            ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0
        )
        self._rows = len(view)
        if self._base:
            self.store.register(self._base, view.nbytes)
        self._io = ChunkIo(self.store, self.key, max(1, int(cfg["batch_chunks"])))
        self._lookups = _PresenceLookups(self, tier_type)
        # Keys of each promotion in flight, so that a failed one marks its keys missing.
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        log.info(
            "kvpool tier: %d chunk rows of %d bytes registered, salt %s, kvpoold %s",
            self._rows,
            self.block_size_bytes,
            self.salt,
            self.store.endpoint,
        )

    @property
    def enabled(self) -> bool:
        """Whether chunks are looked up and stored: False (one warning) when vLLM's block hashes
        are seeded at random in this process. Decided at the first lookup or store, once vLLM
        has seeded them."""
        if self._shareable is None:
            shareable = _hashes_are_shareable()
            if shareable is None:
                return False  # no block hash exists yet
            self._shareable = shareable
            if not shareable:
                log.warning(
                    "kvpool tier: vLLM's block hashes are seeded at random in this process "
                    "(a non-cryptographic prefix hash without PYTHONHASHSEED), so no other "
                    "process could reuse them; the tier will neither look up nor store "
                    "chunks (set PYTHONHASHSEED or use sha256)"
                )
        return self._shareable

    # ----- keys -----

    def key(self, offload_key: OffloadKey) -> str:
        """kvpool's key of one chunk (vLLM's block hash and group index, salted)."""
        return chunk_key(self.salt, offload_key)

    def _ptrs(self, chunk_ids: Iterable[int]) -> list[int]:
        stride = self.block_size_bytes
        out = []
        for c in chunk_ids:
            c = int(c)
            if not 0 <= c < self._rows:
                raise IndexError(f"chunk {c} outside the CPU tier's {self._rows} rows")
            out.append(self._base + c * stride)
        return out

    # ----- lookups -----

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.enabled:
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    # ----- transfers -----

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        if not self.enabled:
            self._io.done(JobResult(job_metadata.job_id, True, transfer_bytes=0))
            return
        try:
            ptrs = self._ptrs(job_metadata.chunk_ids)
        except Exception as e:  # noqa: BLE001 (vLLM must only ever see a failed job)
            log.warning("kvpool tier: store job %d refused: %s", job_metadata.job_id, e)
            self._io.done(JobResult(job_metadata.job_id, False))
            return
        self._io.store(job_metadata.job_id, keys, ptrs, self.block_size_bytes)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        try:
            ptrs = self._ptrs(job_metadata.chunk_ids)
        except Exception as e:  # noqa: BLE001
            log.warning("kvpool tier: load job %d refused: %s", job_metadata.job_id, e)
            self._io.done(JobResult(job_metadata.job_id, False))
            return
        self._io.load(job_metadata.job_id, keys, ptrs, self.block_size_bytes)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Finished stores and promotions; a promotion's keys that did not load are marked
        missing in the lookup verdicts, so the request recomputes them instead of retrying."""
        results = self._io.finished()
        for r in results:
            keys = self._load_keys.pop(r.job_id, None)
            if keys is not None and not r.success:
                loaded = set(r.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in loaded])
        return results

    def has_pending_work(self) -> bool:
        return self._io.busy()

    def drain_jobs(self) -> None:
        self._io.drain()

    # ----- life cycle and metrics -----

    def stats(self) -> dict[str, Any]:
        """The EngineStore counters (lookups, hits, misses, errors, bytes, load latency)."""
        return self.store.stats()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvpool_url", "kvpool_same_host")

    def config_info(self) -> ConfigInfoMapping:
        return {
            "kvpool_url": str(self.settings["kvpool_url"]),
            "kvpool_same_host": bool(self.settings["same_host"]),
        }

    def shutdown(self) -> None:
        """Finishes the transfers in flight, stops the threads and closes the client."""
        self._lookups.shutdown()
        self._io.shutdown()
        if self._base:
            self.store.unregister(self._base)
        self.store.close()

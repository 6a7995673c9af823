"""The vLLM connector's counters: the stats vLLM's logger aggregates and reduces, and the
Prometheus counters it adds to vLLM's ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .engine import Counters

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: EngineStore's counters that travel to vLLM's logger, then the connector's own: how many
#: loads and their seconds, blocks vLLM recomputes after a failed load, saves dropped.
STORE_FIELDS = tuple(f for f in Counters.FIELDS if f != "breaker_opened")
STAT_FIELDS = (
    *STORE_FIELDS,
    "load_count",
    "load_seconds",
    "load_failed_blocks",
    "save_dropped_blocks",
)


@dataclass
class KvpoolConnectorStats(KVConnectorStats):
    """Counters of one interval, summed over workers (``aggregate``) and reduced by vLLM's
    logger (``reduce``). ``data`` holds the fields of ``STAT_FIELDS``."""

    def __post_init__(self) -> None:
        for k in STAT_FIELDS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KvpoolConnectorStats:
        for k in STAT_FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n = d.get("load_count", 0)
        out: dict[str, int | float] = {
            k: d.get(k, 0)
            for k in STAT_FIELDS
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
        return not any(self.data.get(k, 0) for k in STAT_FIELDS)


#: The Prometheus counters the connector adds to vLLM's ``/metrics`` (``vllm:kvpool_<field>``),
#: from the fields of ``STAT_FIELDS``: (field, name suffix, help).
_PROM_COUNTERS = (
    ("lookups", "lookups", "kvpool prefix lookups (one round trip each)"),
    (
        "hits",
        "hit_blocks",
        "objects (one per block, cache group and head group) loaded from kvpool",
    ),
    ("misses", "missed_blocks", "objects asked of kvpool and not loaded"),
    ("errors", "errors", "failed kvpool calls (each a miss or a dropped save)"),
    ("skipped", "skipped_calls", "calls answered as misses while the breaker was open"),
    ("stores", "stored_blocks", "objects stored in kvpool"),
    ("store_failures", "store_failed_blocks", "objects kvpool did not store"),
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

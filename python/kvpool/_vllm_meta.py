"""What both sides of the vLLM connector share: the work the scheduler sends the workers, the
guard that keeps every exception from vLLM, a spec's page size, and how each KV cache group's
blocks are cut into stored objects (one per block and group of KV heads, or per block boundary
and rank for a Mamba state) and which rank writes each."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from .vllm import KvpoolConnector

log = logging.getLogger("kvpool.vllm")

T = TypeVar("T")


def guarded(
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


def page_bytes(spec: Any) -> int:
    """Bytes of one block of one layer, without the padding some specs add for alignment (the
    per-layer views vLLM hands over exclude it; a Mamba state's is ``real_page_size_bytes``)."""
    unpadded = getattr(spec, "unpadded_page_size_bytes", None)
    if unpadded is None:
        unpadded = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    return int(unpadded)


#: A KV cache group's spec kinds the connector stores, by the name in the key salt.
KIND_FULL, KIND_MLA, KIND_SLIDING = "full", "mla", "sliding_window"
#: A Mamba (SSM) state group in vLLM's ``align`` cache mode: one state per block boundary.
KIND_MAMBA = "mamba_state"


@dataclass(frozen=True)
class GroupLayout:
    """How one KV cache group's blocks are stored: one object per (block, group of
    ``heads_per_object`` KV heads), holding those heads' slice of the block's page in each of
    the group's layers (model order). The key names the heads by the model-wide index of the
    first and their count, so any tensor-parallel layout whose ranks hold whole groups of
    heads reads what any other wrote. An MLA latent is one "head" held by every rank."""

    index: int  # the group's index in vLLM's KVCacheConfig
    kind: str  # KIND_FULL, KIND_MLA or KIND_SLIDING
    spec: Any
    total_heads: int  # KV heads of the whole model (1 for an MLA latent)
    heads_per_rank: int
    heads_per_object: int
    # A sliding-window group: tokens below a boundary that a hit there must hold (the
    # window less one, plus vLLM's retained tokens); 0 for every other kind.
    retained_tokens: int = 0
    # Every rank holds the same bytes (a Mamba state vLLM replicates): rank 0 writes them.
    replicated: bool = False

    @property
    def is_state(self) -> bool:
        """A Mamba state group: its object of block ``i`` is the state after the block's
        last token, which vLLM hands over at block boundaries (not by position in the
        request's block table); a hit at a boundary needs that one state only."""
        return self.kind == KIND_MAMBA

    def rank_heads(self, tp_size: int, tp_rank: int) -> list[int]:
        """The model-wide index of the first KV head of each object ``tp_rank`` holds, in its
        page order. vLLM gives each rank ``total / tp`` heads, or one head shared by
        ``tp / total`` ranks."""
        if self.replicated:
            return [0]
        if self.total_heads >= tp_size:
            first = tp_rank * self.heads_per_rank
            return list(
                range(first, first + self.heads_per_rank, self.heads_per_object)
            )
        return [tp_rank * self.total_heads // tp_size]

    def all_heads(self) -> range:
        """The first head of every object of a block, over the whole model."""
        return range(0, self.total_heads, self.heads_per_object)

    def writer(self, head: int, tp_size: int) -> int:
        """The one rank that writes the object starting at ``head``: the lowest that holds it
        (rank 0 for MLA and a replicated state)."""
        if self.replicated:
            return 0
        if self.total_heads >= tp_size:
            return head // self.heads_per_rank
        return -(-head * tp_size // self.total_heads)

    def first_needed(self, boundary: int, block_size: int) -> int:
        """The first block a hit ending at block ``boundary`` needs from this group: 0, or
        for a sliding window the first block vLLM keeps (the earlier ones it nulls)."""
        if not self.retained_tokens:
            return 0
        return max(0, boundary * block_size - self.retained_tokens) // block_size


def group_layout(
    index: int,
    spec: Any,
    model_heads: int | None,
    tp_size: int,
    heads_per_object: int | None = None,
) -> GroupLayout | None:
    """The layout of a group with ``spec``, or None for a kind the connector does not store
    (a Mamba state outside vLLM's ``align`` cache mode, chunked local or cross attention...).
    ``model_heads``: the model's total KV heads, when known; ``heads_per_object``: KV heads
    per stored object (default: all the rank's). Raises ValueError when they do not divide
    the rank's heads."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if type(spec) is MambaSpec:
        # Only the align mode keeps a state per block boundary that a later request can
        # start from; without it vLLM keeps the running state alone.
        if getattr(spec, "mamba_cache_mode", "none") != "align":
            return None
        # The rank's whole page is one object: vLLM shards a state across TP ranks by its
        # own rules (not by KV heads), so a rank's state is keyed by its rank, or once
        # when every rank holds the same (``tp_replicated``).
        heads = max(1, int(getattr(spec, "num_heads", 1) or 1))
        if getattr(spec, "tp_replicated", False):
            return GroupLayout(index, KIND_MAMBA, spec, heads, heads, heads, 0, True)
        return GroupLayout(index, KIND_MAMBA, spec, heads * tp_size, heads, heads)
    per_rank = int(getattr(spec, "num_kv_heads", 0) or 0)
    if per_rank < 1:
        return None
    if isinstance(spec, MLAAttentionSpec):
        return GroupLayout(index, KIND_MLA, spec, 1, 1, 1)
    per_object = heads_per_object or per_rank
    if per_object < 1 or per_rank % per_object:
        raise ValueError(
            f"heads_per_object {per_object} does not divide the {per_rank} KV heads "
            "of a rank"
        )
    total = per_rank * tp_size
    if model_heads and per_rank == max(1, model_heads // tp_size):
        # vLLM's count (with fewer heads than ranks, each is shared by tp / total ranks)
        total = model_heads
    if type(spec) is FullAttentionSpec:
        return GroupLayout(index, KIND_FULL, spec, total, per_rank, per_object)
    if type(spec) is SlidingWindowSpec:
        retained = int(getattr(spec, "num_retained_tokens", spec.sliding_window - 1))
        return GroupLayout(
            index, KIND_SLIDING, spec, total, per_rank, per_object, max(1, retained)
        )
    return None


# ----- what the scheduler sends the workers -----

#: A position of ``BlockJob.group_block_ids`` where the group holds no block (a sliding
#: window's block below the window, which vLLM leaves null).
NO_BLOCK = -1


@dataclass
class BlockJob:
    """Blocks of one request to move: ``block_ids[i]`` holds the block whose vLLM hash is
    ``hashes[i]`` (hex), in the first KV cache group. ``group_block_ids[g][i]`` is that block
    in group ``g`` (``NO_BLOCK`` where the group holds none); empty with a single group."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    group_block_ids: list[list[int]] = field(default_factory=list)

    def groups(self) -> list[list[int]]:
        """Per KV cache group, the block ids aligned with ``hashes``."""
        return self.group_block_ids or [self.block_ids]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: loads (with ``load_async``: the request waits for
    them) and saves of blocks that became full this step."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    load_async: bool = True

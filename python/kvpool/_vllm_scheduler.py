"""The scheduler side of the vLLM connector: which of a request's blocks kvpool holds, the loads
it plans into the request's blocks, and the saves of the blocks that become full and of the
Mamba states vLLM hands over at block boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.outputs import KVConnectorOutput

from ._vllm_meta import NO_BLOCK, BlockJob, KvpoolConnectorMetadata, guarded, log

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    """What the scheduler remembers of one request."""

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    stored: int = 0  # leading blocks known to be in kvpool (matched or saved)
    load: BlockJob | None = None
    load_first: int = 0  # index of the load's first block in the request
    no_load: bool = False  # a load of this request failed: it recomputes from then on


class SchedulerSide:
    """The connector's methods in vLLM's scheduler process (mixed into ``KvpoolConnector``)."""

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
        # Per block, the salts of every object a hit needs (every object of every group, in
        # every pipeline stage), and for each, its group's index in self.layouts.
        self._block_salts: list[str] = []
        self._salt_groups: list[int] = []
        if self.enabled:
            for pp in range(self.pp_size):
                for gi, layout in enumerate(self.layouts):
                    for head in layout.all_heads():
                        self._block_salts.append(self.object_salt(layout, head, pp))
                        self._salt_groups.append(gi)
        # With a sliding window or a Mamba state a hit is not a prefix property: presence.
        self._windowed = any(
            lay.retained_tokens or lay.is_state for lay in self.layouts
        )
        # Mamba state groups by their index in vLLM's KVCacheConfig.
        self._state_groups = {lay.index for lay in self.layouts if lay.is_state}
        self._null_block = 0

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._null_block = kv_cache_manager.block_pool.null_block.block_id

    def _matched_blocks(self, request: Request, first: int) -> int:
        """Leading blocks of ``request`` whose every group holds what a hit there needs (at
        most those before the block of the last token, which is always computed), asking
        kvpool once (one round trip per node) per request and starting block. Without a
        sliding-window or Mamba group that is one ``match_prefix`` over every object of every
        block. With one, a block below the window need not be held, and a Mamba state is
        needed at the boundary only: one ``presence`` of the same keys, and the longest
        boundary whose every group holds what it needs there."""
        seen = self._matches.setdefault(request.request_id, {})
        hit = seen.get(first)
        if hit is not None:
            return hit
        # At most the blocks before the prompt's last token: one token is always computed.
        hashes = request.block_hashes[
            first : (request.num_tokens - 1) // self.block_size
        ]
        n = len(self._block_salts)
        keys = [f"{s}@{h.hex()}" for h in hashes for s in self._block_salts]
        if not keys:
            hit = first
        elif not self._windowed:
            hit = first + self.store.match_prefix(keys) // n
        else:
            hit = first + self._windowed_hit(self.store.presence(keys), first)
        seen[first] = hit
        return hit

    def _windowed_hit(self, present: list[bool], first: int) -> int:
        """The most blocks after ``first`` a hit can take, given each object's presence: at
        boundary ``first + m`` every attention group holds blocks ``max(first, its first
        needed)`` to the boundary (vLLM holds the blocks before ``first`` itself), and every
        Mamba group the state at the boundary (its object of block ``first + m - 1``).
        Linear in the blocks: per group, the run of whole blocks that ends at each block."""
        n = len(self._block_salts)
        blocks = len(present) // n
        whole = [[True] * blocks for _ in self.layouts]  # every object of the block
        for k, ok in enumerate(present):
            if not ok:
                whole[self._salt_groups[k % n]][k // n] = False
        runs = []  # runs[g][i]: whole blocks of group g ending at block i
        for w in whole:
            run, count = [], 0
            for ok in w:
                count = count + 1 if ok else 0
                run.append(count)
            runs.append(run)
        for m in range(blocks, 0, -1):
            if all(
                run[m - 1] >= 1
                if lay.is_state
                else m - max(0, lay.first_needed(first + m, self.block_size) - first)
                <= run[m - 1]
                for lay, run in zip(self.layouts, runs)
            ):
                return m
        return 0

    @guarded(lambda: (0, False))
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
        n = tokens - num_computed_tokens
        if n <= 0:
            return 0, False
        return n, self.load_async

    @guarded(lambda: None)
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remembers the request's blocks; with ``num_external_tokens`` it plans their load."""
        if not self.enabled:
            return
        rid = request.request_id
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        tr = self._reqs.get(rid)
        if tr is None:
            tr = self._reqs[rid] = _Tracked(request)
        if block_ids and block_ids[0]:
            tr.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        # The load starts where vLLM's block-aligned local hit ended (the value it passed to
        # get_num_new_matched_tokens); a load is whole blocks, rounded up.
        local = self._asked.get(rid, 0)
        first = local // self.block_size
        last = first + -(-num_external_tokens // self.block_size)
        job = self._job(tr, first, last, state=True)
        if job is None:
            log.debug("kvpool: %s: no blocks %d..%d to load into", rid, first, last)
            return
        tr.stored = max(tr.stored, self._matches.get(rid, {}).get(first, last))
        tr.load, tr.load_first = job, first
        self._loading[rid] = tr
        self._pending_loads.append(job)

    @guarded(lambda: KvpoolConnectorMetadata())
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        """This step's loads (planned in ``update_state_after_alloc``), the saves of the
        blocks that become full in this step and are not stored yet, and of the Mamba states
        vLLM hands over in this step."""
        meta = KvpoolConnectorMetadata(load_async=self.load_async)
        meta.loads, self._pending_loads = self._pending_loads, []
        if not self.enabled:
            return meta
        sched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            tr = self._reqs.get(nr.req_id)
            if tr is None:
                continue
            tr.block_ids = [list(ids) for ids in nr.block_ids]
            self._forget_matches(nr.req_id)  # a preempted request asks afresh
            self._plan_save(meta, tr, nr.num_computed_tokens + sched.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._reqs.get(rid)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tr.block_ids = [list(ids) for ids in new_ids] if new_ids else []
                self._forget_matches(rid)
            elif new_ids:
                for have, new in zip(tr.block_ids, new_ids):
                    have.extend(new)
            self._plan_save(meta, tr, cached.num_computed_tokens[i] + sched.get(rid, 0))
        if self._state_groups:
            self._plan_state_saves(meta, scheduler_output)
        return meta

    def _plan_state_saves(
        self, meta: KvpoolConnectorMetadata, scheduler_output: SchedulerOutput
    ) -> None:
        """The saves of the Mamba states vLLM's KV cache manager offers in this step
        (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: group, block
        id, boundary tokens; in ``align`` mode, each state cached at a block boundary, which
        this step's forward writes). Each is stored under the hash of the block that ends at
        its boundary. vLLM's table of a Mamba group is not append-only (it nulls interior
        states and moves speculative blocks), so states are taken from these offers only,
        never by position. An offer at a sub-block boundary (vLLM's partial-tail hits) has
        no block hash and is left out."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        num_groups = len(self._kv_cache_config.kv_cache_groups)
        for rid, entries in offers.items():
            tr = self._reqs.get(rid)
            if tr is None:
                continue
            hashes = tr.request.block_hashes
            for group, block_id, boundary in entries:
                if group not in self._state_groups or boundary % self.block_size:
                    continue
                i = boundary // self.block_size - 1
                if not 0 <= i < len(hashes) or block_id == self._null_block:
                    continue
                groups = [[NO_BLOCK] for _ in range(num_groups)]
                groups[group] = [block_id]
                meta.saves.append(BlockJob(rid, [NO_BLOCK], [hashes[i].hex()], groups))

    @guarded(lambda: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learns which loads finished and which blocks failed (with several KV cache groups:
        which requests' loads failed, which vLLM recomputes from the start). A request whose
        load had a failed block is not offered kvpool blocks again (vLLM recomputes it; a
        daemon that keeps failing must not loop it through loads), and its failed blocks will
        be saved again once recomputed."""
        bad = connector_output.invalid_block_ids or set()
        done = connector_output.finished_recving or set()
        failed_reqs = getattr(connector_output, "failed_recving", None) or set()
        for rid, tr in list(self._loading.items()):
            job = tr.load
            if job is None:
                del self._loading[rid]
                continue
            failed = [i for i, b in enumerate(job.block_ids) if b in bad]
            if rid in failed_reqs:
                failed = [0]
            if failed:
                tr.no_load = True
                tr.stored = min(tr.stored, tr.load_first + failed[0])
            if failed or job.req_id in done or not self.load_async:
                tr.load = None  # a synchronous load reports its errors in its own step
                del self._loading[rid]

    def _plan_save(
        self, meta: KvpoolConnectorMetadata, tr: _Tracked, computed: int
    ) -> None:
        full = min(
            computed // self.block_size,
            len(tr.request.block_hashes),
            min(
                (
                    len(ids)
                    for g, ids in enumerate(tr.block_ids)
                    if g not in self._state_groups
                ),
                default=0,
            ),
        )
        if full <= tr.stored:
            return
        job = self._job(tr, tr.stored, full)
        if job is None:
            return
        meta.saves.append(job)
        tr.stored = full

    def _job(
        self, tr: _Tracked, first: int, last: int, state: bool = False
    ) -> BlockJob | None:
        """The job of blocks ``first..last`` of a request, or None when the request has no
        hash or no block for some of them. A group's null block (a sliding window's block
        below the window) becomes ``NO_BLOCK``: nothing to move for that group there. A
        Mamba group moves nothing here (its states are saved from vLLM's offers), except
        with ``state`` (a load): the state at the job's last boundary, into the block vLLM
        allocated at that position, which the request's first forward starts from."""
        hashes = [h.hex() for h in tr.request.block_hashes[first:last]]
        n = len(hashes)
        if not tr.block_ids or n != last - first:
            return None
        groups = []
        for g, ids in enumerate(tr.block_ids):
            if g not in self._state_groups:
                groups.append(ids[first:last])
                continue
            moved = [NO_BLOCK] * n
            if state and n:
                if len(ids) < last or ids[last - 1] == self._null_block:
                    return None  # vLLM gave the state no block: nothing to load into
                moved[-1] = ids[last - 1]
            groups.append(moved)
        if any(len(ids) != n for ids in groups):
            return None
        if len(groups) == 1 and not self._state_groups:
            return BlockJob(tr.request.request_id, groups[0], hashes)
        null = self._null_block
        groups = [[NO_BLOCK if b == null else b for b in ids] for ids in groups]
        return BlockJob(tr.request.request_id, groups[0], hashes, groups)

    @guarded(lambda: (False, None))
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

    @guarded(lambda: (False, None))
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for every KV cache group (vLLM calls this one when the
        connector declares ``SupportsHMA``): the same, since no block is ever held."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def _forget_matches(self, rid: str) -> None:
        self._matches.pop(rid, None)

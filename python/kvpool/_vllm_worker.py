"""The worker side of the vLLM connector: the registered KV caches and staging buffer, the loads
and saves of one worker, and the loader and saver threads that run them."""

from __future__ import annotations

import ctypes
import functools
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)

from ._vllm_meta import (
    NO_BLOCK,
    BlockJob,
    GroupLayout,
    KvpoolConnectorMetadata,
    guarded,
    log,
    page_bytes,
)

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata

_memmove = ctypes.memmove


@dataclass
class _Layer:
    name: str
    # [num_blocks, kernel blocks, objects, heads per object, tokens, content]
    view: torch.Tensor
    block_stride: int  # bytes between two blocks
    sub_stride: int  # bytes between two kernel blocks of a block
    object_stride: int  # bytes between two objects' heads in a kernel block
    piece: int  # bytes of one object's [heads, tokens, content] in one kernel block
    dense: bool  # that [heads, tokens, content] is contiguous

    @property
    def run_bytes(self) -> int:
        """Bytes of one object in this layer (its runs in every kernel block)."""
        return self.view.shape[1] * self.piece

    def spans(self, obj: int) -> list[tuple[int, int, int]]:
        """Object ``obj`` (its index in the rank's page) in block 0, one (pointer, block
        stride, length) per kernel block: block ``b``'s run starts ``b`` strides further."""
        base = self.view.data_ptr() + obj * self.object_stride
        return [
            (base + k * self.sub_stride, self.block_stride, self.piece)
            for k in range(self.view.shape[1])
        ]


@dataclass
class _Group:
    """One KV cache group as this worker stores it: one object per (block, group of KV
    heads)."""

    layout: GroupLayout
    layers: list[_Layer]
    salts: list[str]  # per object of a block this rank holds (page order)
    writes: list[int]  # the objects (page order) this rank writes
    offset: int  # of this group's objects inside a staging slot

    @property
    def object_bytes(self) -> int:
        return sum(lay.run_bytes for lay in self.layers)

    @functools.cached_property
    def spans(self) -> list[list[tuple[int, int, int]]]:
        """Per object of the rank's page, its runs over the layers (``_Layer.spans``)."""
        return [
            [span for lay in self.layers for span in lay.spans(j)]
            for j in range(len(self.salts))
        ]

    def pieces(self, block: int, obj: int) -> list[tuple[int, int]]:
        """(pointer, length) of object ``obj`` of ``block`` in the cache, in object order."""
        return [(p + block * stride, n) for p, stride, n in self.spans[obj]]


@dataclass
class _Item:
    """One object of one block: group, its index in the rank's page, block id, key, staging
    slot."""

    group: _Group
    obj: int
    block: int
    key: str
    slot: int

    def slot_offset(self) -> int:
        return self.group.offset + self.obj * self.group.object_bytes


class WorkerSide:
    """The connector's methods in each vLLM worker process (mixed into ``KvpoolConnector``)."""

    def _init_worker(self) -> None:
        self._groups: list[_Group] = []
        self._block_bytes = 0
        self._staging: torch.Tensor | None = None
        # Host-memory caches whose pages are registered with the store: loads go straight
        # into the pages (no staging copy); the registered regions, to unregister.
        self._direct: list[int] = []
        self._free_slots: list[int] = []
        self._slots_cv = threading.Condition()
        self._jobs: queue.Queue[tuple[BlockJob, bool, threading.Event] | None] = (
            queue.Queue()
        )
        self._saves: queue.Queue[tuple[list[_Item], list[int]] | None] = queue.Queue()
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()  # with several groups: loads that failed
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

    @guarded(lambda: None)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes vLLM's per-layer KV tensors (each a view ``[num_blocks, heads, tokens,
        content]`` of its cache allocation), finds each layer's block and object strides,
        allocates and registers the host staging buffer and starts the loader and saver."""
        if not self.enabled:
            return
        kcc = self._kv_cache_config
        tp_rank, pp_rank = self._ranks
        groups: list[_Group] = []
        offset = 0
        for layout in self.layouts:
            layers = self._group_layers(
                layout, kcc.kv_cache_groups[layout.index].layer_names, kv_caches
            )
            heads = layout.rank_heads(self.tp_size, tp_rank)
            group = _Group(
                layout,
                layers,
                [self.object_salt(layout, h, pp_rank) for h in heads],
                [
                    j
                    for j, h in enumerate(heads)
                    if layout.writer(h, self.tp_size) == tp_rank
                ],
                offset,
            )
            groups.append(group)
            offset += len(heads) * group.object_bytes
        self._groups = groups
        self._block_bytes = offset
        slots = max(2, int(self.config["staging_blocks"]))
        pin = torch.cuda.is_available()
        self._staging = torch.empty((slots, offset), dtype=torch.uint8, pin_memory=pin)
        self._free_slots = list(range(slots))
        self.store.register(self._staging.data_ptr(), slots * offset)
        layers = [lay for g in groups for lay in g.layers]
        self._device = layers[0].view.device
        if self._device.type == "cpu" and all(lay.dense for lay in layers):
            regions: dict[int, int] = {}
            for lay in layers:
                v = lay.view
                p, stride, n = lay.spans(v.shape[2] - 1)[-1]
                size = p + (v.shape[0] - 1) * stride + n - v.data_ptr()
                regions[v.data_ptr()] = max(regions.get(v.data_ptr(), 0), size)
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
            "kvpool: %d groups, %d layers, %d bytes per block, %d staging slots, "
            "salt %s (tp %d/%d, pp %d/%d)",
            len(groups),
            len(layers),
            offset,
            slots,
            groups[0].salts[0],
            tp_rank,
            self.tp_size,
            pp_rank,
            self.pp_size,
        )

    def _group_layers(
        self,
        layout: GroupLayout,
        names: list[str],
        kv_caches: dict[str, torch.Tensor],
    ) -> list[_Layer]:
        """A group's layers, each viewed ``[num_blocks, kernel blocks, objects, heads per
        object, tokens, content]`` (vLLM may split a block into kernel blocks; an object's
        heads are adjacent in vLLM's logical page); raises ValueError for a tensor
        that is not vLLM's paged layout of this group's spec. Groups overlay each other's
        memory (a block id belongs to one group at a time), so only a layer that shares
        another's cache within the group (KV sharing) is left out."""
        seen: set[tuple[int, tuple[int, ...]]] = set()
        num_blocks = self._kv_cache_config.num_blocks
        want = page_bytes(layout.spec)
        layers: list[_Layer] = []
        for name in names:
            t = kv_caches.get(name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"layer {name}: not a paged KV tensor")
            if t.shape[0] % num_blocks:  # kernel blocks: a whole number per block
                raise ValueError(f"layer {name}: {t.shape[0]} blocks for {num_blocks}")
            if t.shape[1] != layout.heads_per_rank:
                raise ValueError(
                    f"layer {name}: {t.shape[1]} heads, spec says {layout.heads_per_rank}"
                )
            per_object = layout.heads_per_object
            v = t.unflatten(0, (num_blocks, -1)).unflatten(2, (-1, per_object))
            ident = (v.data_ptr(), tuple(v.shape))
            if ident in seen:  # a layer that shares another's cache (KV sharing)
                continue
            seen.add(ident)
            es = v.element_size()
            if v[0].numel() * es != want:
                raise ValueError(
                    f"layer {name}: pages of {v[0].numel() * es} bytes, spec says {want}"
                )
            layers.append(
                _Layer(
                    name,
                    v,
                    v.stride(0) * es,
                    v.stride(1) * es,
                    v.stride(2) * es,
                    v[0, 0, 0].numel() * es,
                    v[0, 0, 0].is_contiguous(),
                )
            )
        if not layers:
            raise ValueError(f"no KV cache layers of group {layout.index} to register")
        return layers

    @property
    def block_strides(self) -> dict[str, int]:
        """Per layer, the bytes between two consecutive blocks in vLLM's cache."""
        return {lay.name: lay.block_stride for g in self._groups for lay in g.layers}

    @property
    def object_bytes(self) -> int:
        """Bytes this rank holds of one block: its objects of every group (the
        staging slot size); what a load of one block reads."""
        return self._block_bytes

    @property
    def stored_object_bytes(self) -> int:
        """Size of one stored object of the first group: its KV heads of one block, in every
        layer of the group."""
        return self._groups[0].object_bytes if self._groups else 0

    def key(self, block_hash_hex: str) -> str:
        """This worker's key of the first object of a block (first group, first heads)."""
        return f"{self._groups[0].salts[0]}@{block_hash_hex}"

    def keys(self, block_hash_hex: str, writes: bool = False) -> list[str]:
        """This worker's keys of a block: every group's every object it holds, or (``writes``)
        only those it writes."""
        return [
            f"{g.salts[j]}@{block_hash_hex}"
            for g in self._groups
            for j in (g.writes if writes else range(len(g.salts)))
        ]

    def _items(
        self, job: BlockJob, start: int, slots: list[int], writes: bool
    ) -> list[_Item]:
        """The objects of blocks ``start..start + len(slots)`` of a job: every group's object
        (``writes``: those this rank writes), skipping a group's ``NO_BLOCK``."""
        out: list[_Item] = []
        groups = job.groups()
        for i, slot in enumerate(slots):
            h = job.hashes[start + i]
            for g in self._groups:
                b = groups[g.layout.index][start + i]
                if b == NO_BLOCK:
                    continue
                for j in g.writes if writes else range(len(g.salts)):
                    out.append(_Item(g, j, b, f"{g.salts[j]}@{h}", slot))
        return out

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
        return self._staging.data_ptr() + slot * self._block_bytes

    def _host_pages(self, block_ids: Iterable[int]) -> bool:
        """Whether the cache is in host memory with each object's run of a page contiguous, so
        that it is one ``memmove``; raises IndexError for a block id out of range."""
        layers = [lay for g in self._groups for lay in g.layers]
        if self._device.type != "cpu" or not all(lay.dense for lay in layers):
            return False
        num_blocks = layers[0].view.shape[0]
        if any(not (0 <= b < num_blocks or b == NO_BLOCK) for b in block_ids):
            raise IndexError(f"a block id outside 0..{num_blocks}")
        return True

    def _slot_objects(self, group: _Group) -> torch.Tensor:
        """The staging buffer's bytes of ``group`` as ``[slots, objects, layers, run bytes]``
        (every layer of a group has the same run size)."""
        assert self._staging is not None
        n = len(group.salts) * group.object_bytes
        hb = group.layers[0].run_bytes
        region = self._staging[:, group.offset : group.offset + n]
        return region.view(-1, len(group.salts), len(group.layers), hb)

    def _gather(self, items: list[_Item]) -> None:
        """Copies the objects' bytes from the cache into their staging slots. It runs on the
        step's stream after the forward, and ``.cpu()`` waits for the device copy. A
        host-memory cache takes one ``memmove`` per object, layer and kernel block (torch's
        byte-wise indexed assignment into the slots took 2.2 s per 512 MiB on one core, the
        memmoves 0.06 s)."""
        if self._host_pages(it.block for it in items):
            for it in items:
                dst = self._slot_ptr(it.slot) + it.slot_offset()
                for src, size in it.group.pieces(it.block, it.obj):
                    _memmove(dst, src, size)
                    dst += size
            return
        for group, its in self._by_group(items):
            target = self._slot_objects(group)
            bt, ot, st = self._indices(its, self._device)
            st, oc = st.cpu(), ot.cpu()
            for li, lay in enumerate(group.layers):
                vals = lay.view[bt, :, ot].contiguous().view(torch.uint8)
                target[st, oc, li] = vals.reshape(len(its), -1).cpu()

    def _scatter(self, items: list[_Item]) -> None:
        """Copies the objects' bytes from their staging slots into the cache. A cache in host
        memory whose object runs are contiguous takes one ``memmove`` each: torch's byte-wise
        gather of the slots and ``index_copy_`` move 512 MiB in about 0.6 s on one core, the
        memmoves in 0.06-0.09 s."""
        if self._host_pages(it.block for it in items):
            for it in items:
                src = self._slot_ptr(it.slot) + it.slot_offset()
                for dst, size in it.group.pieces(it.block, it.obj):
                    _memmove(dst, src, size)
                    src += size
            return
        for group, its in self._by_group(items):
            source = self._slot_objects(group)
            bt, ot, _ = self._indices(its, self._device)
            _, oc, st = self._indices(its, torch.device("cpu"))
            for li, lay in enumerate(group.layers):
                raw = source[st, oc, li].to(self._device).view(lay.view.dtype)
                lay.view[bt, :, ot] = raw.reshape(
                    len(its), *lay.view.shape[1:2], *lay.view.shape[3:]
                )
        if self._device.type == "cuda":
            # Device copies are queued, not done: the load is reported finished only once
            # they are, since the request's forward may run on another stream.
            torch.cuda.current_stream(self._device).synchronize()

    @staticmethod
    def _by_group(items: list[_Item]) -> list[tuple[_Group, list[_Item]]]:
        out: dict[int, tuple[_Group, list[_Item]]] = {}
        for it in items:
            out.setdefault(id(it.group), (it.group, []))[1].append(it)
        return list(out.values())

    @staticmethod
    def _indices(
        items: list[_Item], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block ids, objects and slots of the items, as index tensors on ``device``."""

        def idx(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return (
            idx([it.block for it in items]),
            idx([it.obj for it in items]),
            idx([it.slot for it in items]),
        )

    # loads

    @guarded(lambda: None)
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

    @guarded(lambda: None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing left to wait for: synchronous loads completed in ``start_load_kv``, and
        asynchronous ones belong to requests that are not in this forward."""
        self._wait_sync_loads()

    def _wait_sync_loads(self) -> None:
        pending, self._sync_pending = self._sync_pending, []
        for ev in pending:
            ev.wait()

    def _load_failed(self, job: BlockJob, block_ids: list[int], is_async: bool) -> None:
        """Records failed blocks of a load: their ids (one group), or the request (several
        groups, whose block ids vLLM cannot map back, or a Mamba state: it recomputes the
        request)."""
        with self._lock:
            if not is_async:
                self._sync_failed.add(job.req_id)
            if self.per_request_failures:
                self._failed_reqs.add(job.req_id)
            else:
                self._failed_blocks.update(block_ids)
            self._failed_total += len(block_ids)

    def _load(self, job: BlockJob, is_async: bool) -> None:
        """Loads a job's blocks in batches of ``batch_blocks``: each block's objects (every
        group, every object this rank holds) in one call per batch. A block is good only when
        every object of it loaded."""
        batch = max(1, int(self.config["batch_blocks"]))
        # Straight into a host-memory cache's pages: copied from kvpoold's memory on its host,
        # received from the socket into them elsewhere; no staging slot, no scatter.
        direct = bool(self._direct) and self._host_pages(
            b for ids in job.groups() for b in ids
        )
        n = len(job.hashes)
        i = 0
        while i < n:
            if direct:
                slots = list(range(min(batch, n - i)))  # block positions, no staging
            else:
                slots = self._take_slots(min(batch, n - i), None)
            ids = job.block_ids[i : i + len(slots)]
            items = self._items(job, i, slots, writes=False)
            try:
                ok = self._load_items(items, direct)
                bad = {it.slot for it, o in zip(items, ok) if not o}
                if not direct:
                    good = [it for it in items if it.slot not in bad]
                    if good:
                        self._scatter(good)
                bad_ids = [b for k, b in enumerate(ids) if slots[k] in bad]
            except Exception as e:  # noqa: BLE001 (a failed load is a recompute)
                self._note_error("load", e)
                bad_ids = ids
            finally:
                if not direct:
                    self._give_slots(slots)
            i += len(slots)
            if bad_ids:
                self._load_failed(job, bad_ids, is_async)

    def _load_items(self, items: list[_Item], direct: bool) -> list[bool]:
        """One batched load of the objects: into their staging slots, or (``direct``)
        straight into a host-memory cache's pages (each object into its run of every
        layer, verified in the same pass). A block that fails may be left half-written; it is
        reported, and vLLM recomputes it over those bytes."""
        keys = [it.key for it in items]
        if direct:
            pieces = [it.group.pieces(it.block, it.obj) for it in items]
            return self.store.load_scattered(keys, pieces)
        return self.store.load(
            keys,
            [self._slot_ptr(it.slot) + it.slot_offset() for it in items],
            [it.group.object_bytes for it in items],
        )

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
                self._jobs.task_done()

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

    @guarded(lambda: None)
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
            n = len(job.hashes)
            i = 0
            while i < n:
                if not self._items(job, i, list(range(min(batch, n - i))), writes=True):
                    i += batch  # nothing this rank writes (an MLA latent on rank > 0)
                    continue
                slots = self._take_slots(min(batch, n - i), timeout)
                if not slots:
                    with self._lock:
                        self._dropped_total += n - i
                    break
                items = self._items(job, i, slots, writes=True)
                i += len(slots)
                try:
                    self._gather(items)
                except Exception:
                    self._give_slots(slots)
                    raise
                self._saves.put((items, slots))

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            items, slots = item
            try:
                self.store.save(
                    [it.key for it in items],
                    [self._slot_ptr(it.slot) + it.slot_offset() for it in items],
                    [it.group.object_bytes for it in items],
                )
            except Exception as e:  # noqa: BLE001 (a failed save is a future miss)
                self._note_error("save", e)
            finally:
                self._give_slots(slots)
                self._saves.task_done()

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until every queued load and save has finished; whether they did in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._slots_cv:
                idle = (
                    self._staging is None
                    or len(self._free_slots) == self._staging.shape[0]
                )
            # unfinished_tasks: queued or running (a load into the pages holds no slot)
            if idle and not self._jobs.unfinished_tasks + self._saves.unfinished_tasks:
                return True
            time.sleep(0.005)
        return False

    # completions

    @guarded(lambda: (None, None))
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

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """``get_finished``'s loads, and among them (with several KV cache groups, whose block
        ids vLLM cannot map back to requests) those that failed: vLLM recomputes them."""
        _, done = self.get_finished(finished_req_ids)
        done = set(done or ())
        with self._lock:
            failed = self._failed_reqs & done
            self._failed_reqs -= failed
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    @guarded(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Exactly the blocks whose load failed since the last call; vLLM recomputes them."""
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

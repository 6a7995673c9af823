"""The worker side of the vLLM connector: the registered KV caches and staging buffer, the loads
and saves of one worker, and the loader and saver threads that run them."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._vllm_meta import BlockJob, KvpoolConnectorMetadata, guarded, log, page_bytes

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata

_memmove = ctypes.memmove


@dataclass
class _Layer:
    name: str
    cache: torch.Tensor  # blocks first: [num_blocks, heads, tokens, content]
    page_bytes: int
    block_stride: int  # bytes between two blocks of this layer
    offset: int  # of this layer's page inside one object


class WorkerSide:
    """The connector's methods in each vLLM worker process (mixed into ``KvpoolConnector``)."""

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

    @guarded(lambda: None)
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
        if any(lay.page_bytes != page_bytes(spec) for lay in layers):
            raise ValueError(
                f"page of {layers[0].page_bytes} bytes, spec says {page_bytes(spec)}"
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

    @guarded(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Exactly the blocks whose load failed since the last call; vLLM recomputes them."""
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

"""The GPU side of vLLM's CPU tier, on a host without a GPU: for tests and benchmarks.

vLLM's ``OffloadingConnector`` moves blocks between the GPU KV cache and its CPU tier with
``CPUOffloadingWorker`` (CUDA streams and copy kernels), which its spec refuses to build on a
CPU-only platform. :func:`use_host_copies` gives a worker-role connector :class:`HostCopyWorker`
instead: the same ``OffloadingWorker`` calls, on the same shared CPU-tier region and in the same
direct layout (each KV tensor's page of a block in that tensor's slot of the worker's part of
the chunk row), done with one ``memmove`` per page. Everything above it (vLLM's scheduler, its
offloading manager, the CPU tier and its secondary tiers) is vLLM's own code. One KV cache
group and one block per chunk (vLLM's defaults for a full-attention model) are supported.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

_memmove = ctypes.memmove


class HostCopyWorker(OffloadingWorker):
    """Copies pages between KV tensors in host memory and the CPU tier's rows, synchronously;
    results are reported by the next ``get_finished``."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion):
        if len(kv_caches.group_data_refs) != 1:
            raise ValueError("host copies support one KV cache group")
        self._region = region
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            src = t.tensor.view(torch.int8)
            self._pairs.append((src, region.create_next_worker_view(page), page))
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: Any, to_cpu: bool) -> bool:
        blocks, chunks = list(gpu.block_ids), list(cpu.block_ids)
        if len(blocks) != len(chunks):
            raise ValueError("host copies support one block per chunk")
        start = time.perf_counter()
        for dev, host, page in self._pairs:
            dev_base, dev_stride = dev.data_ptr(), dev.stride(0)
            host_base, host_stride = host.data_ptr(), host.stride(0)
            for b, c in zip(blocks, chunks):
                d, h = dev_base + int(b) * dev_stride, host_base + int(c) * host_stride
                if to_cpu:
                    _memmove(h, d, page)
                else:
                    _memmove(d, h, page)
        size = len(blocks) * sum(page for _, _, page in self._pairs)
        self._done.append(
            TransferResult(job_id, True, size, time.perf_counter() - start)
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_cpu=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished inside its submit call

    def shutdown(self) -> None:
        self._pairs = []
        self._region.cleanup()


def use_host_copies(connector: Any) -> None:
    """Makes a worker-role ``OffloadingConnector`` (before ``register_kv_caches``) copy with
    :class:`HostCopyWorker` into the CPU tier's shared region of its engine, which the
    scheduler's connector created."""
    spec = connector.connector_worker.spec

    def get_worker(kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        rank = 0 if spec.replicated_layout else spec.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        return HostCopyWorker(kv_caches, region)

    spec.get_worker = get_worker

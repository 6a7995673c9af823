"""The engine of ``vllm_offload_load.py``: vLLM's real scheduler with its ``OffloadingConnector``
(``TieringOffloadingSpec``, its CPU tier in shared memory, and kvpool as the secondary tier or
no secondary tier), and a worker-role connector on per-layer KV tensors from vLLM's
``allocate_kv_cache``, driven in the model runner's order. The GPU-to-CPU-tier copy, which
needs CUDA in vLLM, is ``kvpool._vllm_offload_host.HostCopyWorker`` (memmoves)."""

from __future__ import annotations

import json
import os
import time

import torch
from _load_common import HEAD_DIM, HEADS, LAYERS, TOKENS
from _load_vllm import LLAMA3_8B

BLOCK = 16
CHUNK = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2  # one block of every layer: 2 MiB
# The GPU cache and the CPU tier each hold the 4096-token prompt and a little more.
NUM_BLOCKS = TOKENS // BLOCK + 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def model_dir(tmp: str) -> str:
    d = os.path.join(tmp, "llama3-8b")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    return d


class OffloadEngine:
    """One engine: ``url`` None gives vLLM's CPU tier alone, else kvpool as its secondary tier
    (``same_host`` as the tier setting). ``source[name][i]`` is what the "forward" writes into
    the block of a request's ``i``-th block position."""

    def __init__(self, path: str, url: str | None, same_host: bool, source: dict):
        from kvpool._vllm_offload_host import use_host_copies
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        tiers = []
        if url is not None:
            tiers.append(
                {
                    "type": "KvpoolTier",
                    "module_path": "kvpool.vllm_offload",
                    "kvpool_url": url,
                    "same_host": same_host,
                    "io_timeout": 60.0,
                    "lookup_timeout": 5.0,
                }
            )
        kvt = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": NUM_BLOCKS * CHUNK,
                "secondary_tiers": tiers,
            },
        )
        vc = VllmConfig(
            model_config=ModelConfig(
                model=path,
                skip_tokenizer_init=True,
                dtype="bfloat16",
                max_model_len=8192,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=8192,
                max_model_len=8192,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=kvt,
        )
        vc.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_size=HEAD_DIM,
            dtype=torch.bfloat16,
        )
        page = spec.page_size_bytes
        kcc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * NUM_BLOCKS * LAYERS,
                    layers=list(NAMES),
                    layer_stride=page * NUM_BLOCKS,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)],
        )
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK,
        )
        self.conn = self.sched.connector
        self.manager = self.conn.connector_scheduler.manager
        self.tier = self.manager.secondary_tiers[0] if tiers else None
        self.worker = KVConnectorFactory.create_connector(
            vc, KVConnectorRole.WORKER, kcc
        )
        use_host_copies(self.worker)
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker.register_kv_caches(self.kv)
        self.source = source
        self.steps = 0

    def add(self, rid: str, prompt: list[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)  # what the engine core does at start (a fixed seed)
        self.sched.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
        )

    def step(self):
        """One engine step in the model runner's order; the "forward" copies ``source`` into
        the blocks of the new requests' computed tokens. A step that ran no forward while
        requests wait sleeps 1 ms, as vLLM's engine core does, so that transfer threads run."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        for nr in out.scheduled_new_reqs:
            first = nr.num_computed_tokens // BLOCK
            ids = nr.block_ids[0][first : TOKENS // BLOCK]
            for name in NAMES:
                for i, b in enumerate(ids, first):
                    self.kv[name][b].copy_(self.source[name][i])
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(set(out.finished_req_ids))
        kvo = KVConnectorOutput(
            finished_recving=res.finished_recving or None,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        self.sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=kvo,
            ),
        )
        if not out.total_num_scheduled_tokens and self.sched.has_requests():
            time.sleep(0.001)
        return out

    def run(self, rid: str, max_steps: int = 100_000):
        """Steps until ``rid`` is scheduled; its NewRequestData."""
        for _ in range(max_steps):
            for nr in self.step().scheduled_new_reqs:
                if nr.req_id == rid:
                    return nr
        raise RuntimeError(f"{rid} was never scheduled")

    def settle(self, max_steps: int = 100_000) -> None:
        """Steps until every transfer (CPU tier stores, write-through to kvpool) is done."""
        for _ in range(max_steps):
            self.step()
            if (
                not self.conn.has_pending_push_work()
                and not self.manager.has_pending_work()
            ):
                return
        raise RuntimeError("transfers never finished")

    def matches(self, block_ids: list[int]) -> bool:
        """Whether the blocks hold ``source``, bit for bit."""
        return all(
            torch.equal(
                self.kv[n][b].view(torch.int16), self.source[n][i].view(torch.int16)
            )
            for n in NAMES
            for i, b in enumerate(block_ids)
        )

    def close(self) -> None:
        self.worker.shutdown()
        self.conn.shutdown()

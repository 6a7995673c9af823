"""vLLM's side of ``connector_load.py``: the worker-role ``KvpoolConnector`` loading into
per-layer KV tensors from vLLM's ``allocate_kv_cache``."""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch
from _load_common import HEAD_DIM, HEADS, LAYERS, TOKENS

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "head_dim": HEAD_DIM,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}


class VLLM:
    """Two worker-role KvpoolConnectors (same host, TCP), each on its own per-layer KV tensors
    from vLLM's ``allocate_kv_cache`` (256 blocks of 16 tokens, layer-compact), built from the
    ``--kv-transfer-config`` of docs/ENGINES.md by vLLM's connector factory."""

    BLOCK = 16

    def __init__(self, tcp: str, tmp: str):
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        self.blocks = TOKENS // self.BLOCK
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(
            block_size=self.BLOCK,
            num_kv_heads=HEADS,
            head_size=HEAD_DIM,
            dtype=torch.bfloat16,
        )
        page = spec.page_size_bytes
        self.kcc = KVCacheConfig(
            num_blocks=self.blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * self.blocks * LAYERS,
                    layers=list(self.names),
                    layer_stride=page * self.blocks,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(self.names), spec)],
        )
        d = os.path.join(tmp, "llama3-8b")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(LLAMA3_8B, f)
        self.workers = {
            "same host": self._worker(d, tcp, True),
            "TCP": self._worker(d, tcp, False),
        }
        self.nbytes = self.blocks * self.workers["TCP"][0].object_bytes
        self.ids = list(range(self.blocks))
        self.hashes = [
            hashlib.sha256(f"vllm-{i}".encode()).hexdigest() for i in range(self.blocks)
        ]

    def _worker(self, path: str, tcp: str, same_host: bool):
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
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        kvt = KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "kvpool_url": f"tcp://{tcp}",
                "io_timeout": 60.0,
                "lookup_timeout": 5.0,
                "same_host": same_host,
                "load_async": False,
            },
        )
        mc = ModelConfig(
            model=path,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=TOKENS,
        )
        vc = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=self.BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=TOKENS,
                max_model_len=TOKENS,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=kvt,
        )
        vc.cache_config.num_gpu_blocks = self.blocks
        w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, self.kcc)
        kv = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
        w.register_kv_caches(kv)
        assert w.store.is_local == same_host
        return w, kv

    def _meta(self, loads: bool):
        from kvpool.vllm import BlockJob, KvpoolConnectorMetadata

        job = BlockJob("bench", list(self.ids), list(self.hashes))
        if loads:
            return KvpoolConnectorMetadata(loads=[job], load_async=False)
        return KvpoolConnectorMetadata(saves=[job], load_async=False)

    def save(self) -> None:
        w, kv = self.workers["same host"]
        g = torch.Generator().manual_seed(2)
        self.ref = []
        for n in self.names:
            t = kv[n].view(torch.int16)
            t.copy_(
                torch.randint(-30000, 30000, t.shape, generator=g, dtype=torch.int16)
            )
            self.ref.append(t.clone())
        w.bind_connector_metadata(self._meta(loads=False))
        w.wait_for_save()
        assert w.flush(120.0)
        w.clear_connector_metadata()
        st = w.store.stats()
        assert st["stores"] == self.blocks, st
        for w2, kv2 in self.workers.values():
            for n in self.names:
                kv2[n].zero_()

    def load(self, mode: str) -> None:
        w, _ = self.workers[mode]
        w.bind_connector_metadata(self._meta(loads=True))
        w.start_load_kv(None)  # synchronous: waits for the loader thread
        bad = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        assert not bad, f"vLLM {mode}: {len(bad)} blocks did not load"

    def check(self) -> bool:
        return all(
            torch.equal(kv[n].view(torch.int16), r)
            for _, kv in self.workers.values()
            for n, r in zip(self.names, self.ref)
        )

    def pieces(self, mode: str) -> dict:
        """One load with the connector's steps timed: on the same host,
        ``EngineStore.load_scattered`` of a batch straight into the 32 layers' pages; over TCP,
        ``EngineStore.load`` into the staging slots and ``_scatter`` of the slots into the
        pages."""
        w, _ = self.workers[mode]
        spent = {"store_load": 0.0, "scatter": 0.0, "load_scattered": 0.0}
        orig_load, orig_scatter = w.store.load, w._scatter
        orig_scattered = w.store.load_scattered

        def timed(name, fn):
            def run(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[name] += time.perf_counter() - t

            return run

        w.store.load = timed("store_load", orig_load)
        w.store.load_scattered = timed("load_scattered", orig_scattered)
        w._scatter = timed("scatter", orig_scatter)
        try:
            t = time.perf_counter()
            self.load(mode)
            total = time.perf_counter() - t
        finally:
            del w.store.load, w.store.load_scattered, w._scatter
        return {
            "batch_blocks": int(w.config["batch_blocks"]),
            "object_bytes": w.object_bytes,
            "total_ms": total * 1e3,
            "engine_store_load_scattered_ms": spent["load_scattered"] * 1e3,
            "engine_store_load_ms": spent["store_load"] * 1e3,
            "scatter_ms": spent["scatter"] * 1e3,
        }

    def close(self) -> None:
        for w, _ in self.workers.values():
            w.shutdown()

"""SGLang's side of ``connector_load.py``: ``KvpoolStore.batch_get_v1`` into a real
``MHATokenToKVPoolHost``."""

from __future__ import annotations

import hashlib
import time

import torch
from _load_common import HEAD_DIM, HEADS, LAYERS, TOKENS, best_of


class SGLang:
    """SGLang's real host pool (page_first, 64-token pages, room for the source and the
    destination) and one KvpoolStore per mode, built by SGLang's own backend factory."""

    PAGE = 64

    def __init__(self, tcp: str):
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MHABufferInfo,
        )
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        page, bf16 = self.PAGE, torch.bfloat16
        k = tuple(torch.zeros(page, HEADS, HEAD_DIM, dtype=bf16) for _ in range(LAYERS))
        v = tuple(torch.zeros(page, HEADS, HEAD_DIM, dtype=bf16) for _ in range(LAYERS))
        ptrs = [
            torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)
        ]
        info = MHABufferInfo(
            buffers=KVBuffers(
                k=k,
                v=v,
                k_data_ptrs=ptrs[0],
                v_data_ptrs=ptrs[1],
                layout=KVBufferLayout.NHD,
            ),
            page_size=page,
            head_num=HEADS,
            head_dim=HEAD_DIM,
            v_head_dim=HEAD_DIM,
            dtype=bf16,
            device=torch.device("cpu"),
        )
        self.pool = MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            page,
            "page_first",
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=page,
            start_layer=0,
            end_layer=LAYERS,
            host_token_capacity=2 * TOKENS,
        )
        self.batch = STORAGE_BATCH_SIZE
        self.pages = TOKENS // page
        self.keys = [
            hashlib.sha256(f"sgl-{i}".encode()).hexdigest() for i in range(self.pages)
        ]
        self.src = self.pool.alloc(TOKENS)
        self.dst = self.pool.alloc(TOKENS)
        self.nbytes = TOKENS * self.pool.get_size_per_token()
        self.stores = {
            "same host": self._store(tcp, same_host=True),
            "TCP": self._store(tcp, same_host=False),
        }

    def _store(self, tcp: str, same_host: bool):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        cfg = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="meta-llama/Meta-Llama-3-8B",
            extra_config={
                "backend_name": "kvpool",
                "module_path": "kvpool.sglang",
                "class_name": "KvpoolStore",
                "interface_v1": 1,
                "kvpool_url": f"tcp://{tcp}",
                "lookup_timeout_ms": 5000,
                "io_timeout_ms": 60000,
                "kvpool_same_host": same_host,
            },
        )
        store = StorageBackendFactory.create_backend("dynamic", cfg, self.pool)
        store.register_mem_pool_host(self.pool)
        store.on_host_pools_registered()
        assert store.store.is_local == same_host
        return store

    def save(self) -> None:
        g = torch.Generator().manual_seed(1)
        idx = self.src.long()
        kv = self.pool.kv_buffer  # page_first: [2, tokens, layers, heads, dim]
        fill = torch.randint(
            -30000, 30000, (2, TOKENS, *kv.shape[2:]), generator=g, dtype=torch.int16
        )
        kv.view(torch.int16)[:, idx] = fill
        self.ref = kv.view(torch.int16)[:, idx].clone()
        store, p = self.stores["same host"], self.PAGE
        for i in range(0, self.pages, self.batch):
            assert all(
                store.batch_set_v1(
                    self.keys[i : i + self.batch],
                    self.src[i * p : (i + self.batch) * p],
                )
            )
        kv.view(torch.int16)[:, self.dst.long()] = 0

    def load(self, mode: str) -> None:
        store, p = self.stores[mode], self.PAGE
        for i in range(0, self.pages, self.batch):
            ok = store.batch_get_v1(
                self.keys[i : i + self.batch], self.dst[i * p : (i + self.batch) * p]
            )
            assert all(ok), f"SGLang {mode}: a page did not load"

    def check(self) -> bool:
        got = self.pool.kv_buffer.view(torch.int16)[:, self.dst.long()]
        return torch.equal(got, self.ref)

    def pieces(self, mode: str) -> dict:
        """The connector's load against ``EngineStore.load`` of the same objects (one call,
        as the connector makes it) and the building of the objects (key strings, SGLang's
        ``get_page_buffer_meta``)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        store = self.stores[mode]
        t = time.perf_counter()
        objs = store._objects(PoolName.KV, self.pool, self.keys, self.dst)
        build = time.perf_counter() - t
        keys = objs.keys
        ptrs = [s[0][0] for s in objs.segs]
        sizes = [s[0][1] for s in objs.segs]
        raw = best_of(lambda: store.store.load(keys, ptrs, sizes), 3)
        return {
            "objects": len(keys),
            "object_bytes": sizes[0],
            "build_objects_ms": build * 1e3,
            "engine_store_load_ms": raw * 1e3,
        }

    def close(self) -> None:
        for s in self.stores.values():
            s.close()

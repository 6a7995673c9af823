"""LMCache's side of ``connector_load.py``: ``RemoteBackend.batched_get_blocking`` on
``KvpoolRemoteConnector`` into ``MemoryObj``\\ s from a real ``LocalCPUBackend``."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import torch
from _load_common import HEAD_DIM, HEADS, LAYERS, TOKENS, best_of

LMCACHE_YAML = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: {cpu_gb}
remote_storage_plugins: ["kvpool"]
extra_config:
  remote_storage_plugin.kvpool.module_path: kvpool.lmcache
  remote_storage_plugin.kvpool.class_name: KvpoolConnectorAdapter
  remote_storage_plugin.kvpool.url: "kvpool://{addr}"
  remote_storage_plugin.kvpool.lookup_timeout_ms: 5000
  remote_storage_plugin.kvpool.io_timeout_ms: 60000
  remote_storage_plugin.kvpool.same_host: {same_host}
"""


class LMCache:
    """Two LMCache storage stacks (same host, TCP) built by LMCache's ``CreateStorageBackends``
    from the YAML of docs/ENGINES.md: a real ``LocalCPUBackend`` (its arena) and a real
    ``RemoteBackend`` on ``KvpoolRemoteConnector``. 16 chunks of 256 tokens (32 MiB each)."""

    CHUNK = 256

    def __init__(self, tcp: str, tmp: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stacks = {
            "same host": self._stack(tcp, tmp, True, 1.2),
            "TCP": self._stack(tcp, tmp, False, 0.7),
        }
        self.n = TOKENS // self.CHUNK
        md = self.stacks["TCP"]["metadata"]
        from lmcache.utils import CacheEngineKey

        self.keys = [
            CacheEngineKey(
                md.model_name, md.world_size, md.worker_id, 0x5000 + i, md.kv_dtype
            )
            for i in range(self.n)
        ]
        self.nbytes = 0
        self.got: dict[str, list] = {}

    def _stack(self, tcp: str, tmp: str, same_host: bool, cpu_gb: float) -> dict:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        path = os.path.join(tmp, f"lmcache-{same_host}.yaml")
        with open(path, "w") as f:
            f.write(
                LMCACHE_YAML.format(
                    cpu_gb=cpu_gb, addr=tcp, same_host=str(same_host).lower()
                )
            )
        config = LMCacheEngineConfig.from_file(path)
        md = LMCacheMetadata(
            model_name="meta-llama/Meta-Llama-3-8B",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(LAYERS, 2, self.CHUNK, HEADS, HEAD_DIM),
            use_mla=False,
        )
        backends = CreateStorageBackends(config, md, self.loop)
        remote = backends["RemoteBackend-kvpool"]
        conn = remote.connection.getWrappedConnector()
        assert conn.store.is_local == same_host
        return {
            "backends": backends,
            "cpu": backends["LocalCPUBackend"],
            "remote": remote,
            "conn": conn,
            "metadata": md,
        }

    def save(self) -> None:
        st = self.stacks["same host"]
        md = st["metadata"]
        g = torch.Generator().manual_seed(3)
        objs, self.ref = [], []
        for _ in self.keys:
            o = st["cpu"].allocate(md.get_shapes(), md.get_dtypes())
            assert o is not None, "LMCache's CPU arena is too small"
            raw = o.tensor.view(torch.int16)
            raw.copy_(
                torch.randint(-30000, 30000, raw.shape, generator=g, dtype=torch.int16)
            )
            self.ref.append(raw.clone())
            objs.append(o)
        self.nbytes = sum(o.get_size() for o in objs)
        done = threading.Semaphore(0)
        st["remote"].batched_submit_put_task(
            self.keys, objs, on_complete_callback=lambda _k: done.release()
        )
        for _ in self.keys:
            assert done.acquire(timeout=120), "LMCache's batched put did not finish"
        for o in objs:
            o.ref_count_down()
        assert st["conn"].stats()["stores"] == self.n

    def load(self, mode: str) -> None:
        for o in self.got.pop(mode, []):
            o.ref_count_down()  # the previous round's chunks go back to the arena
        got = self.stacks[mode]["remote"].batched_get_blocking(self.keys)
        assert all(o is not None for o in got), f"LMCache {mode}: a chunk did not load"
        self.got[mode] = got

    def check(self) -> bool:
        return (
            all(
                torch.equal(o.tensor.view(torch.int16), r)
                for got in self.got.values()
                for o, r in zip(got, self.ref)
            )
            and len(self.got) == 2
        )

    def pieces(self, mode: str) -> dict:
        """The get against its allocation of the MemoryObjs from the arena and the
        ``EngineStore.load_lengths`` call (one, for the 16 chunks) it makes."""
        st = self.stacks[mode]
        for o in self.got.pop(mode, []):
            o.ref_count_down()
        conn, md = st["conn"], st["metadata"]
        t = time.perf_counter()
        objs = [st["cpu"].allocate(md.get_shapes(), md.get_dtypes()) for _ in self.keys]
        alloc = time.perf_counter() - t
        keys = [conn.kvpool_key(k) for k in self.keys]
        ptrs = [o.data_ptr for o in objs]
        sizes = [o.get_size() for o in objs]
        raw = best_of(lambda: conn.store.load_lengths(keys, ptrs, sizes), 3)
        for o in objs:
            o.ref_count_down()
        return {
            "chunks": len(keys),
            "chunk_bytes": sizes[0],
            "allocate_ms": alloc * 1e3,
            "engine_store_load_ms": raw * 1e3,
        }

    def close(self) -> None:
        for got in self.got.values():
            for o in got:
                o.ref_count_down()
        for st in self.stacks.values():
            for b in reversed(list(st["backends"].values())):
                b.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

"""Loads 4096 tokens of Llama-3-8B-shaped KV (512 MiB bf16) through each engine connector, on
the same host and over loopback TCP, next to a memcpy and a raw TCP stream of the same bytes.

Usage: python connector_load.py --kvpoold target/release/kvpoold [--rounds 5] [--pieces]
[--out bench-out/connector-load.json]

One run, one kvpoold of its own (data directory under /dev/shm, loopback ports, stopped at the
end). The KV is stored once per connector, then loaded through each connector's real load
path, as its engine calls it, into that engine's real host memory:

* SGLang: ``KvpoolStore.batch_get_v1`` into a real ``MHATokenToKVPoolHost`` (page_first, 64-token
  pages, SGLang's batches of ``STORAGE_BATCH_SIZE`` = 128 pages);
* vLLM: the worker-role ``KvpoolConnector`` (synchronous load: ``bind_connector_metadata``,
  ``start_load_kv``, which waits for the loader thread) into per-layer KV tensors allocated by
  vLLM's ``allocate_kv_cache`` (16-token blocks, the connector's default 16-block batches;
  on the same host each block's object straight into its 32 layers' pages, over TCP through
  the 64-slot staging buffer);
* LMCache: ``RemoteBackend.batched_get_blocking`` (LMCache's real ``RemoteBackend``, whose
  connector is ``KvpoolRemoteConnector``) into ``MemoryObj``\\ s of 256-token chunks allocated
  from its real ``LocalCPUBackend``.

Each connector twice: same host (the default) and over loopback TCP (vLLM's and LMCache's
``same_host: false``, SGLang's ``kvpool_same_host: false``). Every round measures, in this
order, a single-thread memcpy of 512 MiB (``ctypes.memmove`` between two preallocated,
pre-touched buffers; also, as context, the same bytes in 4 MiB memmoves), a raw TCP stream of 512 MiB over loopback (a server subprocess
``sendall``-ing one preallocated buffer in reply to an 8-byte request; the client
``recv_into`` a preallocated buffer), then the six connector loads. Best and median over the
rounds; ratios of the medians (and of the bests). Loaded bytes are compared with the stored
ones at the end. ``--pieces`` times parts of each load apart (after the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _daemons import Kvpoold

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKENS = 4096
MIB = 1 << 20
GIB = 1 << 30


# ----- kvpoold -----


# ----- baselines -----


class Memcpy:
    """One thread, libc memcpy between two preallocated, pre-touched buffers."""

    def __init__(self, nbytes: int):
        self.n = nbytes
        self.src = torch.full((nbytes,), 3, dtype=torch.uint8)
        self.dst = torch.full((nbytes,), 0, dtype=torch.uint8)

    def run(self) -> None:
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.n)

    def run_pieces(self, piece: int = 4 * MIB) -> None:
        """The same bytes in ``piece``-sized memmoves (a context row, not the goal's
        baseline): one copy of 512 MiB can use glibc's non-temporal stores, copies of a few
        MiB cannot."""
        src, dst = self.src.data_ptr(), self.dst.data_ptr()
        for o in range(0, self.n, piece):
            ctypes.memmove(dst + o, src + o, min(piece, self.n - o))


SERVER = r"""
import socket, sys
n = int(sys.argv[1])
buf = bytearray(b"\x07") * n          # written, so its pages are real memory
view = memoryview(buf)
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(1)
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    req = c.recv(8)
    if len(req) < 8:
        break
    c.sendall(view[: int.from_bytes(req, "little")])
"""


class RawTcp:
    """A raw TCP stream over loopback: a server process ``sendall``s ``nbytes`` of one
    preallocated buffer per 8-byte request; this process ``recv_into`` a preallocated buffer
    (no framing, no copies beyond the kernel's)."""

    def __init__(self, nbytes: int):
        self.n = nbytes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(nbytes)], stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = torch.full((nbytes,), 0, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy()).cast("B")

    def run(self) -> None:
        self.sock.sendall(self.n.to_bytes(8, "little"))
        got, view, n = 0, self.view, self.n
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError("the raw TCP server closed")
            got += r

    def run_hashed(self) -> None:
        """The stream received in reads of at most 64 KiB, each hashed with xxh3-64 as it
        arrives (the shape of the client's verified TCP receive)."""
        import xxhash

        h = xxhash.xxh3_64()
        self.sock.sendall(self.n.to_bytes(8, "little"))
        got, view, n = 0, self.view, self.n
        while got < n:
            r = self.sock.recv_into(view[got:], min(64 << 10, n - got))
            if r == 0:
                raise ConnectionError("the raw TCP server closed")
            h.update(view[got : got + r])
            got += r

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


# ----- SGLang -----


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


# ----- vLLM -----


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


# ----- LMCache -----


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


# ----- models of the client's own work -----


def verify_models(nbytes: int, memcpy: Memcpy) -> dict:
    """What kvpool's client does to a value besides moving it: it hashes every 64 KiB chunk
    with xxh3-64 right after copying it (docs/ARCHITECTURE.md), and checks the sum. Timed with
    the Python ``xxhash`` package (the same C xxh3), one thread: the hash alone over a chunk
    that stays in cache, a Python loop of one memmove per 64 KiB chunk, and of memmove + hash per
    64 KiB chunk (the shape of the client's verified same-host copy, plus about 1 us of Python
    per call), next to one memcpy of the whole."""
    try:
        import xxhash
    except ImportError:
        return {"skipped": "the xxhash package is not installed"}
    chunk = 64 << 10
    n = nbytes // chunk
    src, dst = memcpy.src.data_ptr(), memcpy.dst.data_ptr()
    mv = memoryview(memcpy.dst.numpy()).cast("B")

    def hash_only() -> None:
        h = xxhash.xxh3_64()
        one = mv[:chunk]
        for _ in range(n):
            h.update(one)

    def copy_chunks() -> None:
        for i in range(n):
            o = i * chunk
            ctypes.memmove(dst + o, src + o, chunk)

    def copy_then_hash() -> None:
        h = xxhash.xxh3_64()
        for i in range(n):
            o = i * chunk
            ctypes.memmove(dst + o, src + o, chunk)
            h.update(mv[o : o + chunk])

    return {
        "xxh3_64_in_cache_ms": best_of(hash_only, 3) * 1e3,
        "memmove_per_64KiB_ms": best_of(copy_chunks, 3) * 1e3,
        "memmove_then_xxh3_per_64KiB_ms": best_of(copy_then_hash, 3) * 1e3,
        "memcpy_ms": best_of(memcpy.run, 3) * 1e3,
    }


# ----- measuring -----


def best_of(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def summary(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {
        "best_gibps": nbytes / GIB / min(times),
        "median_gibps": nbytes / GIB / med,
        "best_ms": min(times) * 1e3,
        "median_ms": med * 1e3,
        "times_ms": [round(t * 1e3, 2) for t in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpoold", default="target/release/kvpoold")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", default="2GiB", help="kvpoold's --memory")
    ap.add_argument("--pieces", action="store_true", help="time parts of each load")
    ap.add_argument("--goal", type=float, default=0.8)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()

    logging_quiet()
    tmp = tempfile.mkdtemp(prefix="kvpool-load-")
    daemon = Kvpoold(a.kvpoold, a.memory, prefix="kvpool-load-")
    tcp = daemon.tcp
    made: list = []
    raw_tcp = None
    try:
        t0 = time.perf_counter()
        sgl = SGLang(tcp)
        made.append(sgl)
        vl = VLLM(tcp, tmp)
        made.append(vl)
        lmc = LMCache(tcp, tmp)
        made.append(lmc)
        for c in made:
            c.save()
        nbytes = sgl.nbytes
        assert vl.nbytes == nbytes and lmc.nbytes == nbytes, (
            sgl.nbytes,
            vl.nbytes,
            lmc.nbytes,
        )
        memcpy = Memcpy(nbytes)
        raw_tcp = RawTcp(nbytes)
        print(
            f"set up and stored 3 x {nbytes >> 20} MiB in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        runs = {
            "memcpy": memcpy.run,
            "memcpy 4 MiB pieces": memcpy.run_pieces,
            "raw TCP": raw_tcp.run,
        }
        for name, c in (("SGLang", sgl), ("vLLM", vl), ("LMCache", lmc)):
            for mode in ("same host", "TCP"):
                runs[f"{name} {mode}"] = lambda c=c, m=mode: c.load(m)
        for fn in runs.values():  # warm up: first touches, connections, threads
            fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        load_avg = [os.getloadavg()[0]]
        for r in range(a.rounds):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
            load_avg.append(os.getloadavg()[0])
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
        checks = {"SGLang": sgl.check(), "vLLM": vl.check(), "LMCache": lmc.check()}
        pieces = {}
        if a.pieces:
            for name, c in (("SGLang", sgl), ("vLLM", vl), ("LMCache", lmc)):
                for mode in ("same host", "TCP"):
                    pieces[f"{name} {mode}"] = c.pieces(mode)
            pieces["client verify model"] = verify_models(nbytes, memcpy)
            if "skipped" not in pieces["client verify model"]:
                pieces["client verify model"]["raw_tcp_ms"] = (
                    best_of(raw_tcp.run, 3) * 1e3
                )
                pieces["client verify model"]["raw_tcp_64KiB_reads_xxh3_ms"] = (
                    best_of(raw_tcp.run_hashed, 3) * 1e3
                )
    finally:
        for c in reversed(made):
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 (keep closing the rest)
                print(f"closing {type(c).__name__}: {e!r}", file=sys.stderr)
        if raw_tcp is not None:
            raw_tcp.close()
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    res = {k: summary(v, nbytes) for k, v in times.items()}
    for name, r in res.items():
        if name in ("memcpy", "memcpy 4 MiB pieces", "raw TCP"):
            continue
        if name.endswith("same host"):
            pieces_gibps = res["memcpy 4 MiB pieces"]["median_gibps"]
            r["ratio_median_vs_memcpy_pieces"] = r["median_gibps"] / pieces_gibps
        base = res["memcpy" if name.endswith("same host") else "raw TCP"]
        r["baseline"] = "memcpy" if name.endswith("same host") else "raw TCP"
        r["ratio_median"] = r["median_gibps"] / base["median_gibps"]
        r["ratio_best"] = r["best_gibps"] / base["best_gibps"]
        r["goal"] = a.goal
        r["met"] = r["ratio_median"] >= a.goal
    out = {
        "bytes": nbytes,
        "tokens": TOKENS,
        "rounds": a.rounds,
        "load_average_1m": [round(x, 2) for x in load_avg],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bytes_verified": checks,
        "results": res,
    }
    if pieces:
        out["pieces"] = pieces
    print_table(out)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    if not all(checks.values()):
        sys.exit(f"loaded bytes differ from the stored ones: {checks}")


def logging_quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    for name in ("kvpool", "lmcache", "vllm", "sglang"):
        logging.getLogger(name).setLevel(logging.WARNING)


def print_table(out: dict) -> None:
    la = out["load_average_1m"]
    print(
        f"{out['bytes'] >> 20} MiB ({out['tokens']} tokens of Llama-3-8B KV, bf16), "
        f"{out['rounds']} rounds; load average {min(la):.2f}-{max(la):.2f}; "
        f"bytes verified: {out['bytes_verified']}"
    )
    hdr = f"{'load':<19} {'best GiB/s':>10} {'median GiB/s':>12} {'median ms':>9}  ratio (median; best)"
    print(hdr)
    print("-" * len(hdr))
    for name, r in out["results"].items():
        line = (
            f"{name:<19} {r['best_gibps']:>10.2f} {r['median_gibps']:>12.2f} "
            f"{r['median_ms']:>9.1f}"
        )
        if "ratio_median" in r:
            verdict = "met" if r["met"] else "MISSED"
            line += (
                f"  {r['ratio_median']:.2f}x {r['baseline']} ({r['ratio_best']:.2f}x); "
                f"goal >= {r['goal']}x: {verdict}"
            )
        if "ratio_median_vs_memcpy_pieces" in r:
            line += f"; {r['ratio_median_vs_memcpy_pieces']:.2f}x 4 MiB pieces"
        print(line)
    for name, p in out.get("pieces", {}).items():
        print(
            f"pieces {name}: "
            + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in p.items()
            )
        )


if __name__ == "__main__":
    main()

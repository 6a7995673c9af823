"""Loads 4096 tokens of Llama-3-8B-shaped KV (512 MiB bf16) through kvpool.sglang into SGLang's
real host pool, next to a memcpy of the same bytes.

Usage: python sglang_load.py --kvpoold target/release/kvpoold [--layout page_first]
[--page 64] [--tokens 4096] [--rounds 5]

It starts its own kvpoold (data directory under /dev/shm, stopped at the end), stores the pages
with ``batch_set_v1`` from one half of a real ``MHATokenToKVPoolHost`` (32 layers, 8 KV heads,
head dim 128, bf16) and loads them with ``batch_get_v1`` into the other half, in SGLang's
batches of 128 pages, printing the best of ``--rounds`` against the best copy of as many
bytes with libc's memcpy (``ctypes.memmove``, one thread).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYERS, HEADS, HEAD_DIM = 32, 8, 128


def host_pool(layout: str, page: int, tokens: int) -> MHATokenToKVPoolHost:
    bf16 = torch.bfloat16
    k = tuple(torch.zeros(page, HEADS, HEAD_DIM, dtype=bf16) for _ in range(LAYERS))
    v = tuple(torch.zeros(page, HEADS, HEAD_DIM, dtype=bf16) for _ in range(LAYERS))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
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
    pool = MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=page,
        start_layer=0,
        end_layer=LAYERS,
        host_token_capacity=2 * tokens,
    )
    pool.kv_buffer.view(-1).view(torch.uint8).fill_(7)
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kvpoold", required=True)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    data = tempfile.mkdtemp(prefix="kvpool-sgl-", dir="/dev/shm")
    cmd = [a.kvpoold, "--data-dir", data, "--memory", "2GiB", "--tcp", "127.0.0.1:0"]
    cmd += ["--quic", "127.0.0.1:0", "--metrics", "127.0.0.1:0"]
    daemon = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, env=dict(os.environ, KVPOOL_LOG="warn")
    )
    try:
        assert daemon.stdout is not None
        ready = daemon.stdout.readline().decode()
        tcp = next(w[4:] for w in ready.split() if w.startswith("tcp="))
        pool = host_pool(a.layout, a.page, a.tokens)
        cfg = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=a.layout == "page_first",
            model_name="meta-llama/Meta-Llama-3-8B",
            extra_config={
                "backend_name": "kvpool",
                "module_path": "kvpool.sglang",
                "class_name": "KvpoolStore",
                "interface_v1": 1,
                "kvpool_url": f"tcp://{tcp}",
                "lookup_timeout_ms": 5000,
                "io_timeout_ms": 60000,
            },
        )
        store = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        store.register_mem_pool_host(pool)
        store.on_host_pools_registered()
        n = a.tokens // a.page
        keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]
        src, dst = pool.alloc(n * a.page), pool.alloc(n * a.page)
        b = STORAGE_BATCH_SIZE
        for i in range(0, n, b):
            assert all(
                store.batch_set_v1(keys[i : i + b], src[i * a.page : (i + b) * a.page])
            )
        best = float("inf")
        for _ in range(a.rounds):
            t = time.perf_counter()
            for i in range(0, n, b):
                ok = store.batch_get_v1(
                    keys[i : i + b], dst[i * a.page : (i + b) * a.page]
                )
                assert all(ok)
            best = min(best, time.perf_counter() - t)
        nbytes = n * a.page * pool.get_size_per_token()
        x = torch.full((nbytes,), 3, dtype=torch.uint8)
        y = torch.empty_like(x)
        copy = float("inf")
        for _ in range(a.rounds):
            t = time.perf_counter()
            ctypes.memmove(y.data_ptr(), x.data_ptr(), nbytes)
            copy = min(copy, time.perf_counter() - t)
        gib = nbytes / 2**30
        where = "same host" if store.store.is_local else "loopback TCP"
        print(
            f"{a.layout} page {a.page}: {nbytes >> 20} MiB in {best * 1e3:.0f} ms "
            f"({gib / best:.2f} GiB/s, {where}); memcpy {gib / copy:.2f} GiB/s; "
            f"ratio {copy / best:.2f}"
        )
        store.close()
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()

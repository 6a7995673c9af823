"""kvpool.sglang.KvpoolStore against a real kvpoold, driven through SGLang's own classes.

Everything SGLang-side is the real sglang 0.5.23: ``HiCacheStorageConfig``, the dynamic
``StorageBackendFactory`` with the launch line's extra-config, the real ``MHATokenToKVPoolHost``
(Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16) and ``MLATokenToKVPoolHost`` (one
576-wide latent per token) in each host layout, and SGLang's ``HiCacheStorageFailureInjector``.
The calls come in the controller's order: register, on_host_pools_registered, batch_exists in
batches of 128 pages, batch_set_v1 (backup thread), batch_get_v1 into other host indices
(prefetch thread). Pages are compared byte for byte. Host pools are kept to a few pages.
"""

from __future__ import annotations

import hashlib
import logging
import threading

import pytest
from conftest import in_ci

try:
    import torch
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MambaStateBufferInfo,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import (
        STORAGE_BATCH_SIZE,
        HiCacheStorageConfig,
        HiCacheStorageFailureInjector,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError as e:  # pragma: no cover (CI installs sglang: scripts/python-env)
    if in_ci():
        raise
    pytest.skip(f"sglang is not installed ({e})", allow_module_level=True)

import kvpool
from kvpool.sglang import KvpoolStore

LAYERS, HEADS, HEAD_DIM, LATENT = 32, 8, 128, 576
BF16 = torch.bfloat16
MODEL = "meta-llama/Meta-Llama-3-8B"


def launch_config(url: str, **more) -> dict:
    """The launch line's extra-config (docs/ENGINES.md), at the test daemon's address, with
    deadlines a loaded 2-core CI machine meets (the defaults are 5 ms and 2 s)."""
    cfg = {
        "backend_name": "kvpool",
        "module_path": "kvpool.sglang",
        "class_name": "KvpoolStore",
        "interface_v1": 1,
        "kvpool_url": url,
        "lookup_timeout_ms": 5000,
        "io_timeout_ms": 20000,
    }
    cfg.update(more)
    return cfg


def storage_config(
    url: str,
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = MODEL,
    page_first: bool = True,
    metrics: bool = False,
    extra: dict | None = None,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=launch_config(url) if extra is None else extra,
    )


def mha_pool(
    layout: str,
    page: int,
    pages: int = 6,
    *,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
) -> MHATokenToKVPoolHost:
    """SGLang's real MHA host pool over one page of CPU "device" buffers, filled with random
    bytes (each page distinct)."""
    k = tuple(torch.zeros(page, heads, head_dim, dtype=BF16) for _ in range(layers))
    v = tuple(torch.zeros(page, heads, head_dim, dtype=BF16) for _ in range(layers))
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
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=BF16,
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
        end_layer=layers,
        host_token_capacity=pages * page,
    )
    randomize(pool, seed)
    return pool


def mla_pool(
    layout: str, page: int, pages: int = 6, seed: int = 0
) -> MLATokenToKVPoolHost:
    bufs = tuple(torch.zeros(page, 1, LATENT, dtype=BF16) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=page,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        kv_cache_dim=LATENT,
        dtype=BF16,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(
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
        target_layer_num=LAYERS,
        host_token_capacity=pages * page,
    )
    randomize(pool, seed)
    return pool


def randomize(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_hashes(n: int, tag: str = "p") -> list[str]:
    """SGLang-like page hashes: 64 hex digits each."""
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def attach(cfg: HiCacheStorageConfig, pool, sidecars=()):
    """What HiCacheController.attach_storage_backend does (the hybrid controller registers
    sidecars before firing on_host_pools_registered)."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    for p, name in sidecars:
        backend.register_mem_host_pool_v2(p, name)
    backend.on_host_pools_registered()
    return backend


def hit_pages(backend, keys: list[str]) -> int:
    """The prefetch thread's _storage_hit_query: 128-page batches, stop at a short one."""
    hit = 0
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        n = backend.batch_exists(batch)
        hit += n
        if n < len(batch):
            break
    return hit


def backup(backend, keys, indices, page) -> bool:
    """The backup thread's _page_backup: all(batch_set_v1) per 128-page batch."""
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        idx = indices[i * page : (i + len(batch)) * page]
        if not all(backend.batch_set_v1(batch, idx)):
            return False
    return True


def prefetch(backend, keys, indices, page) -> int:
    """The prefetch I/O thread's _page_transfer: the leading run of loaded pages."""
    done = 0
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        idx = indices[i * page : (i + len(batch)) * page]
        res = backend.batch_get_v1(batch, idx)
        n = res.index(False) if False in res else len(res)
        done += n
        if n < len(batch):
            break
    return done


def page_bytes(pool, index: int) -> torch.Tensor:
    return pool.get_data_page(int(index), flat=True).contiguous().view(torch.uint8)


def same_pages(pool_a, idx_a, pool_b, idx_b, n: int, page: int) -> bool:
    return all(
        torch.equal(
            page_bytes(pool_a, idx_a[i * page]), page_bytes(pool_b, idx_b[i * page])
        )
        for i in range(n)
    )


# ----- loading and configuration -----


def test_dynamic_factory_loads_kvpoolstore_with_the_launch_config(kvpoold):
    # Exactly the launch line's extra-config (docs/ENGINES.md), at this daemon's address.
    exact = {
        "backend_name": "kvpool",
        "module_path": "kvpool.sglang",
        "class_name": "KvpoolStore",
        "interface_v1": 1,
        "kvpool_url": kvpoold.url,
    }
    pool = mha_pool("page_first", 16, pages=2)
    backend = attach(storage_config(kvpoold.url, extra=exact), pool)
    assert type(backend) is KvpoolStore
    assert backend.zero_copy and backend.config["kvpool_url"] == kvpoold.url
    assert (
        backend.config["lookup_timeout_ms"] == 5
        and backend.config["io_timeout_ms"] == 2000
    )
    assert backend.registered_pools[PoolName.KV] is pool
    backend.close()


def test_bad_extra_config_fails_the_attach_loudly(kvpoold, monkeypatch):
    monkeypatch.delenv("KVPOOL_URL", raising=False)
    no_url = launch_config(kvpoold.url)
    del no_url["kvpool_url"]
    with pytest.raises(ValueError, match="kvpool_url"):
        KvpoolStore(storage_config(kvpoold.url, extra=no_url))
    monkeypatch.setenv("KVPOOL_URL", kvpoold.url)
    assert KvpoolStore(storage_config(kvpoold.url, extra=no_url)).config[
        "kvpool_url"
    ] == (kvpoold.url)
    with pytest.raises(ValueError, match="unknown kvpool"):
        KvpoolStore(
            storage_config(kvpoold.url, extra=launch_config(kvpoold.url, kvpool_urls=1))
        )
    with pytest.raises(ValueError, match="lookup_timeout_ms"):
        KvpoolStore(
            storage_config(
                kvpoold.url, extra=launch_config(kvpoold.url, lookup_timeout_ms=0)
            )
        )
    with pytest.raises(ValueError, match="kvpool_same_host"):
        KvpoolStore(
            storage_config(
                kvpoold.url, extra=launch_config(kvpoold.url, kvpool_same_host="no")
            )
        )
    # The same-host path is on by default and can be turned off.
    assert KvpoolStore(storage_config(kvpoold.url)).store.is_local
    remote = launch_config(kvpoold.url, kvpool_same_host=False)
    assert not KvpoolStore(storage_config(kvpoold.url, extra=remote)).store.is_local
    # A store made while kvpoold is unreachable is not a misconfiguration: it answers misses.
    dead = KvpoolStore(storage_config("tcp://127.0.0.1:1"))
    assert dead.batch_exists(page_hashes(2)) == 0


def test_unsupported_host_pools_fail_the_attach(kvpoold):
    class Pool:  # a stand-in: only the attributes the check reads
        kv_buffer = torch.zeros(4)
        dtype, page_size, size = BF16, 16, 64

    unified = Pool()
    unified.layout = "page_unified"
    with pytest.raises(ValueError, match="host layouts"):
        KvpoolStore(storage_config(kvpoold.url)).register_mem_pool_host(unified)
    # A sidecar in device memory, during the attach (before on_host_pools_registered).
    backend = KvpoolStore(storage_config(kvpoold.url))
    backend.register_mem_pool_host(mha_pool("page_first", 16, pages=2))
    on_device = Pool()
    on_device.kv_buffer = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="host"):
        backend.register_mem_host_pool_v2(on_device, PoolName.SWA)


# ----- zero copy: every layout, MHA and MLA -----

MHA_CASES = [
    ("page_first", 16),
    ("page_first", 64),
    ("layer_first", 16),
    ("layer_first", 64),
    ("page_first_direct", 16),
]


@pytest.mark.parametrize(("layout", "page"), MHA_CASES)
def test_mha_pages_round_trip_into_other_host_indices(kvpoold, layout, page):
    pool = mha_pool(layout, page, pages=6)
    backend = attach(
        storage_config(kvpoold.url, page_first=layout == "page_first"), pool
    )
    keys = page_hashes(3, f"mha-{layout}-{page}-")
    src = pool.alloc(3 * page)
    assert hit_pages(backend, keys) == 0
    assert backup(backend, keys, src, page)
    assert hit_pages(backend, keys) == 3
    assert backend.batch_exists(keys + page_hashes(1, "absent")) == 3
    assert backend.batch_exists(page_hashes(1, "absent") + keys) == 0
    dst = pool.alloc(3 * page)
    assert not same_pages(pool, src, pool, dst, 3, page)
    assert prefetch(backend, keys, dst, page) == 3
    assert same_pages(pool, src, pool, dst, 3, page)
    # Storing again skips what is there: nothing new is written.
    written = backend.kvpool_stats()["bytes_written"]
    assert backup(backend, keys, src, page)
    assert backend.kvpool_stats()["bytes_written"] == written
    backend.close()


@pytest.mark.parametrize(
    ("layout", "page", "pages"),
    [
        ("page_first", 64, 4),
        ("layer_first", 64, 4),
        (
            "page_first_direct",
            16,
            LAYERS,
        ),  # SGLang's MLA page_first_direct needs pages >= layers
    ],
)
def test_mla_pages_round_trip_into_other_host_indices(kvpoold, layout, page, pages):
    pool = mla_pool(layout, page, pages=pages)
    backend = attach(storage_config(kvpoold.url, mla=True), pool)
    keys = page_hashes(2, f"mla-{layout}-")
    src, dst = pool.alloc(2 * page), pool.alloc(2 * page)
    assert backup(backend, keys, src, page)
    assert hit_pages(backend, keys) == 2
    assert prefetch(backend, keys, dst, page) == 2
    assert same_pages(pool, src, pool, dst, 2, page)
    backend.close()


def test_prefix_longer_than_one_batch_goes_in_batches_of_128_pages(kvpoold):
    page, n = 16, 2 * STORAGE_BATCH_SIZE + 4
    pool = mha_pool("layer_first", page, pages=2 * n, layers=2, heads=2, head_dim=16)
    backend = attach(storage_config(kvpoold.url, page_first=False), pool)
    keys = page_hashes(n, "long-")
    src, dst = pool.alloc(n * page), pool.alloc(n * page)
    assert backup(backend, keys, src, page)
    assert hit_pages(backend, keys) == n
    assert prefetch(backend, keys, dst, page) == n
    assert same_pages(pool, src, pool, dst, n, page)
    # The staging buffer holds one batch of 128 pages of this pool, no more.
    per_page = pool.get_size_per_token() * page
    assert backend.io.staging.numel() == STORAGE_BATCH_SIZE * per_page
    backend.close()


def test_prefetch_and_backup_threads_share_the_staging_buffer(kvpoold):
    """SGLang's backup thread stores while its prefetch I/O thread loads: with layer_first both
    go through the one staging buffer, and neither may see the other's bytes."""
    page, n, rounds = 16, 4, 8
    pool = mha_pool("layer_first", page, pages=4 * n)
    backend = attach(storage_config(kvpoold.url, page_first=False), pool)
    stored = page_hashes(n, "threads-stored-")
    src = pool.alloc(n * page)
    assert backup(backend, stored, src, page)
    errors: list[BaseException] = []

    def backups() -> None:
        try:
            for r in range(rounds):
                idx = pool.alloc(n * page)
                assert backup(backend, page_hashes(n, f"threads-{r}-"), idx, page)
                pool.free(idx)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    t = threading.Thread(target=backups)
    t.start()
    for _ in range(rounds):
        dst = pool.alloc(n * page)
        assert prefetch(backend, stored, dst, page) == n
        assert same_pages(pool, src, pool, dst, n, page)
        pool.free(dst)
    t.join(60)
    assert not t.is_alive() and not errors
    backend.close()


def test_layer_first_and_page_first_direct_objects_hold_the_same_bytes(kvpoold):
    page = 16
    lf = mha_pool("layer_first", page, pages=4, seed=1)
    pd = mha_pool("page_first_direct", page, pages=4, seed=2)
    a = attach(storage_config(kvpoold.url, page_first=False), lf)
    b = attach(storage_config(kvpoold.url, page_first=False), pd)
    assert a.salt == b.salt
    keys = page_hashes(2, "shared-order-")
    src, dst = lf.alloc(2 * page), pd.alloc(2 * page)
    assert backup(a, keys, src, page)
    assert prefetch(b, keys, dst, page) == 2
    for i in range(2):
        s, d = int(src[i * page]), int(dst[i * page]) // page
        # [K/V, layer, token, head, dim] of one page in both pools.
        assert torch.equal(
            lf.kv_buffer[:, :, s : s + page].contiguous().view(torch.uint8),
            pd.kv_buffer[:, d].contiguous().view(torch.uint8),
        )


def test_other_layouts_and_models_never_see_each_others_pages(kvpoold):
    page = 16
    keys = page_hashes(2, "iso-")
    pf = mha_pool("page_first", page, pages=4)
    writer = attach(storage_config(kvpoold.url), pf)
    assert backup(writer, keys, pf.alloc(2 * page), page)
    assert hit_pages(writer, keys) == 2
    lf = mha_pool("layer_first", page, pages=4)
    other_layout = attach(storage_config(kvpoold.url, page_first=False), lf)
    other_model = attach(
        storage_config(kvpoold.url, model="Qwen/Qwen2.5-7B"),
        mha_pool("page_first", page, pages=4),
    )
    for b, pool in ((other_layout, lf), (other_model, other_model.mem_pool_host)):
        assert b.salt != writer.salt
        assert hit_pages(b, keys) == 0
        assert b.batch_get_v1(keys, pool.alloc(2 * page)) == [False, False]
    # A different dtype or page size is another salt too.
    assert (
        attach(storage_config(kvpoold.url), mha_pool("page_first", 64, pages=2)).salt
        != writer.salt
    )


# ----- tensor parallelism -----


def test_mha_tp_ranks_keep_their_own_objects(kvpoold):
    page = 16
    keys = page_hashes(2, "tp-mha-")
    # Llama-3-8B at TP 2: 4 KV heads per rank.
    pools = [
        mha_pool("page_first", page, pages=4, heads=HEADS // 2, seed=r)
        for r in range(2)
    ]
    ranks = [
        attach(storage_config(kvpoold.url, tp_rank=r, tp_size=2), pools[r])
        for r in range(2)
    ]
    src0 = pools[0].alloc(2 * page)
    assert backup(ranks[0], keys, src0, page)
    assert hit_pages(ranks[0], keys) == 2 and hit_pages(ranks[1], keys) == 0
    src1 = pools[1].alloc(2 * page)
    assert backup(ranks[1], keys, src1, page)
    with kvpool.Client(kvpoold.url) as c:
        salt = ranks[0].salt
        for r in range(2):
            assert all(c.exists(f"{salt}_{k}_{r}_{kv}") for k in keys for kv in "kv")
    dst1 = pools[1].alloc(2 * page)
    assert prefetch(ranks[1], keys, dst1, page) == 2
    assert same_pages(pools[1], src1, pools[1], dst1, 2, page)
    # A TP-1 deployment of the same model holds all 8 heads: another salt.
    tp1 = attach(storage_config(kvpoold.url), mha_pool("page_first", page, pages=2))
    assert tp1.salt != salt and hit_pages(tp1, keys) == 0


def test_mla_tp_ranks_share_one_latent_and_only_the_writer_puts(kvpoold):
    page = 64
    pools = [mla_pool("page_first", page, pages=4, seed=r) for r in range(2)]
    ranks = [
        attach(storage_config(kvpoold.url, mla=True, tp_rank=r, tp_size=2), pools[r])
        for r in range(2)
    ]
    assert ranks[0].is_writer and not ranks[1].is_writer
    assert ranks[0].salt == ranks[1].salt
    keys = page_hashes(2, "tp-mla-")
    src = pools[0].alloc(2 * page)
    assert backup(ranks[0], keys, src, page)
    with kvpool.Client(kvpoold.url) as c:
        assert all(c.exists(f"{ranks[0].salt}_{k}__k") for k in keys)
    assert hit_pages(ranks[1], keys) == 2
    dst = pools[1].alloc(2 * page)
    assert prefetch(ranks[1], keys, dst, page) == 2
    assert same_pages(pools[0], src, pools[1], dst, 2, page)
    # The non-writer reports success and puts nothing.
    fresh = page_hashes(2, "tp-mla-fresh-")
    before = ranks[1].kvpool_stats()["stores"]
    assert ranks[1].batch_set_v1(fresh, pools[1].alloc(2 * page)) == [True, True]
    assert ranks[1].kvpool_stats()["stores"] == before
    assert hit_pages(ranks[0], fresh) == 0


# ----- v2: a hybrid model's sidecar pool -----


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v2_sidecar_pool_with_trailing_pages(kvpoold, layout):
    """A sliding-window model: the KV anchor plus an SWA sidecar, itself SGLang's real
    MHATokenToKVPoolHost (smaller), which only holds the trailing window of a prefix. SGLang
    gives every host pool the one --hicache-mem-layout."""
    page, n, window = 16, 6, 2
    kv = mha_pool(layout, page, pages=8)
    swa = mha_pool(layout, page, pages=6, layers=4, seed=7)
    backend = attach(
        storage_config(kvpoold.url, page_first=layout == "page_first"),
        kv,
        [(kv, PoolName.KV), (swa, PoolName.SWA)],
    )
    keys = page_hashes(n, "hybrid-")
    assert backup(backend, keys, kv.alloc(n * page), page)
    tail = keys[-window:]
    swa_src = swa.alloc(window * page)
    got = backend.batch_set_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=swa_src, keys=tail)]
    )
    assert got == {PoolName.SWA: [True, True]}

    trailing = PoolTransfer(
        name=PoolName.SWA, keys=tail, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    res = backend.batch_exists_v2(keys, [trailing])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (n, [n])
    assert res.extra_pool_hit_pages == {PoolName.KV: n, PoolName.SWA: n}
    # The same pool under ALL_PAGES needs every page: none restorable.
    all_pages = PoolTransfer(
        name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES
    )
    assert backend.batch_exists_v2(keys, [all_pages]).kv_hit_pages == 0
    # BLOCK_GROUPS is not served: that pool restores 0 pages and gates nothing; no raise.
    groups = PoolTransfer(
        name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS
    )
    res = backend.batch_exists_v2(keys, [groups])
    assert res.kv_hit_pages == n and PoolName.SWA not in res.extra_pool_hit_pages
    assert backend.batch_get_v2(
        [
            PoolTransfer(
                name=PoolName.SWA,
                host_indices=swa.alloc(window * page),
                keys=tail,
                hit_policy=PoolHitPolicy.BLOCK_GROUPS,
            )
        ]
    ) == {PoolName.SWA: [False, False]}
    # An unregistered pool can't restore anything.
    mamba = PoolTransfer(
        name=PoolName.MAMBA, keys=tail, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    assert backend.batch_exists_v2(keys, [mamba]).kv_hit_pages == 0

    swa_dst = swa.alloc(window * page)
    got = backend.batch_get_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=swa_dst, keys=tail)]
    )
    assert got == {PoolName.SWA: [True, True]}
    assert same_pages(swa, swa_src, swa, swa_dst, window, page)
    # A window one page further back is not stored: restorable stops before it.
    res = backend.batch_exists_v2(keys[:-1], [trailing])
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    backend.close()


def test_v2_real_mamba_state_pool_restores_at_its_checkpoints(kvpoold):
    """A hybrid linear-attention model: SGLang's real MambaPoolHost (one state slot per KV
    page, a temporal and a conv object each, TP-sharded) under TRAILING_PAGES with a window
    of one page: a prefix is restorable only where a state was saved."""
    page, n = 16, 4
    kv = mha_pool("page_first", page, pages=6)
    layers = 4
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, 5, 8, 16, dtype=torch.float32),
        conv=(torch.zeros(layers, 5, 3, 32, dtype=BF16),),
    )
    mamba = MambaPoolHost(
        info,
        2.0,
        0,
        device_capacity=4,
        pin_memory=False,
        device="cpu",
        layout="page_first",
    )
    g = torch.Generator().manual_seed(3)
    for buf in mamba.get_hybrid_pool_buffer():
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    backend = attach(
        storage_config(kvpoold.url), kv, [(kv, PoolName.KV), (mamba, PoolName.MAMBA)]
    )
    keys = page_hashes(n, "mamba-")
    assert backup(backend, keys, kv.alloc(n * page), page)
    state = mamba.alloc(1)
    tail = keys[-1:]
    saved = backend.batch_set_v2(
        [PoolTransfer(name=PoolName.MAMBA, host_indices=state, keys=tail)]
    )
    assert saved == {PoolName.MAMBA: [True]}
    with kvpool.Client(kvpoold.url) as c:
        assert all(
            c.exists(f"{backend.salt}_{tail[0]}_0_{o}") for o in ("temporal", "conv_0")
        )

    def transfer(ks):
        return PoolTransfer(
            name=PoolName.MAMBA, keys=ks, hit_policy=PoolHitPolicy.TRAILING_PAGES
        )

    res = backend.batch_exists_v2(keys, [transfer(tail)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (n, [n])
    assert backend.batch_exists_v2(keys[:2], [transfer(keys[1:2])]).kv_hit_pages == 0
    dst = mamba.alloc(1)
    got = backend.batch_get_v2(
        [PoolTransfer(name=PoolName.MAMBA, host_indices=dst, keys=tail)]
    )
    assert got == {PoolName.MAMBA: [True]}
    assert torch.equal(
        mamba.get_data_page(int(state[0])), mamba.get_data_page(int(dst[0]))
    )
    backend.close()


# ----- the plain interface -----


def test_plain_interface_takes_tensors_and_pointers(kvpoold):
    page = 16
    pool = mha_pool("page_first", page, pages=6)
    cfg = launch_config(kvpoold.url)
    del cfg["interface_v1"]  # SGLang's generic path
    backend = attach(storage_config(kvpoold.url, extra=cfg), pool)
    assert not backend.zero_copy
    keys = page_hashes(3, "plain-")
    src = pool.alloc(3 * page)
    pages = [pool.get_data_page(int(src[i * page])) for i in range(3)]
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    assert backend.batch_set(keys[:2], pages[:2])
    assert backend.batch_exists(keys) == 2 and backend.exists(keys[1])
    dummies = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, dummies)
    assert got[2] is None
    for i in range(2):
        assert got[i] is dummies[i]
        assert torch.equal(got[i].view(torch.uint8), pages[i].view(torch.uint8))
    one = pool.get_dummy_flat_data_page()
    assert backend.get(keys[0], one) is one
    assert torch.equal(one.view(torch.uint8), got[0].view(torch.uint8))
    assert torch.equal(backend.get(keys[0]), pages[0].view(torch.uint8))
    assert backend.get("absent") is None and backend.get("absent", one) is None
    # Pointer + size into registered host memory (Mooncake's form): K of page 2.
    ptrs, sizes = pool.get_page_buffer_meta(src[2 * page : 3 * page])
    assert backend.set(keys[2], target_location=ptrs[0], target_sizes=sizes[0])
    dst = pool.alloc(page)
    dptrs, _ = pool.get_page_buffer_meta(dst)
    assert backend.get(keys[2], dptrs[0], sizes[0]) is True
    d, s = int(dst[0]), int(src[2 * page])
    k = pool.k_buffer.view(torch.uint8)
    assert torch.equal(k[d : d + page], k[s : s + page])
    assert (
        backend.batch_get(keys[:1] + ["absent"], [dptrs[0], dptrs[1]], [sizes[0]] * 2)
        == 0
    )
    assert (
        backend.batch_get([keys[2], "absent"], [dptrs[0], dptrs[1]], [sizes[0]] * 2)
        == 1
    )
    assert backend.batch_set(
        keys[2:], target_locations=[ptrs[0]], target_sizes=[sizes[0]]
    )
    assert backend.clear() and backend.batch_exists(keys) == 0
    backend.close()


# ----- metrics -----


def test_storage_metrics_drain_and_engine_counters(kvpoold):
    page = 16
    pool = mha_pool("page_first", page, pages=6)
    backend = attach(storage_config(kvpoold.url, metrics=True), pool)
    keys = page_hashes(3, "metrics-")
    assert backup(backend, keys, pool.alloc(3 * page), page)
    assert prefetch(backend, keys, pool.alloc(3 * page), page) == 3
    m = backend.get_stats()
    assert isinstance(m, StorageMetrics)
    assert (m.backup_pgs, m.prefetch_pgs) == ([3], [3])
    assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    assert backend.get_stats() == StorageMetrics()  # drained
    s = backend.kvpool_stats()
    assert (s["stores"], s["hits"], s["misses"]) == (6, 6, 0)
    assert s["bytes_read"] == s["bytes_written"] == 3 * pool.get_size_per_token() * page
    assert s["available"] and s["guarded_errors"] == 0
    # Without enable_storage_metrics the StorageMetrics stay empty.
    quiet = attach(storage_config(kvpoold.url), mha_pool("page_first", page, pages=2))
    assert quiet.batch_get_v1(keys[:1], quiet.mem_pool_host.alloc(page)) == [True]
    assert quiet.get_stats() == StorageMetrics()


# ----- failures: misses and False, never an exception -----


def test_sglang_failure_injector_gives_misses_and_correct_hits(kvpoold, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.001")
    page = 16
    pool = mha_pool("layer_first", page, pages=8)
    backend = attach(storage_config(kvpoold.url, page_first=False), pool)
    assert isinstance(backend, HiCacheStorageFailureInjector)
    keys = page_hashes(2, "chaos-")
    src = pool.alloc(2 * page)
    outcomes = set()
    for _ in range(20):
        outcomes.add(backup(backend, keys, src, page))
        n = hit_pages(backend, keys)
        assert 0 <= n <= 2
        dst = pool.alloc(2 * page)
        loaded = prefetch(backend, keys, dst, page)
        assert same_pages(pool, src, pool, dst, loaded, page)  # what loads is right
        pool.free(dst)
    assert outcomes == {True, False}
    assert backend._backend.kvpool_stats()["guarded_errors"] == 0


def test_killed_kvpoold_gives_misses_and_false(start_kvpoold, caplog):
    d = start_kvpoold()
    page = 16
    kv = mha_pool("layer_first", page, pages=8)
    swa = mha_pool("page_first", page, pages=2, layers=2)
    extra = launch_config(
        d.url, lookup_timeout_ms=500, io_timeout_ms=500, failure_threshold=2
    )
    backend = attach(
        storage_config(d.url, page_first=False, extra=extra), kv, [(swa, PoolName.SWA)]
    )
    keys = page_hashes(2, "dead-")
    src = kv.alloc(2 * page)
    assert backup(backend, keys, src, page)
    d.kill()
    caplog.set_level(logging.WARNING)
    idx = kv.alloc(2 * page)
    tr = PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(page), keys=keys[:1])
    for _ in range(3):  # through the breaker opening and while it is open
        assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
        assert backend.batch_get_v1(keys, idx) == [False, False]
        assert backend.batch_set_v1(page_hashes(2, "dead-new-"), idx) == [False, False]
        assert backend.batch_exists_v2(keys, [tr]).kv_hit_pages == 0
        assert backend.batch_get_v2([tr]) == {PoolName.SWA: [False]}
        assert backend.batch_set_v2([tr]) == {PoolName.SWA: [False]}
        assert backend.get(keys[0]) is None and not backend.set(keys[0], torch.zeros(4))
        assert backend.batch_get(keys, [torch.zeros(4), torch.zeros(4)]) == [None, None]
        assert not backend.batch_set(keys, [torch.zeros(4), torch.zeros(4)])
        assert backend.clear() is False
    assert isinstance(backend.get_stats(), StorageMetrics)
    s = backend.kvpool_stats()
    assert not s["available"] and s["breaker_opened"] == 1 and s["skipped"] > 0
    assert s["guarded_errors"] == 0  # the daemon's death is a miss, not a bug
    warnings = [
        r
        for r in caplog.records
        if r.name == "kvpool.engine" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1
    backend.close()
    # A closed store answers misses too.
    assert (
        backend.batch_exists(keys) == 0
        and backend.batch_get_v1(keys, idx) == [False] * 2
    )


def test_malformed_calls_are_misses_not_exceptions(kvpoold):
    page = 16
    pool = mha_pool("page_first", page, pages=4)
    backend = attach(storage_config(kvpoold.url), pool)
    keys = page_hashes(2, "bad-")
    idx = pool.alloc(2 * page)
    assert backend.batch_get_v1(keys, idx[:page]) == [False, False]  # too few indices
    assert backend.batch_set_v1(keys, None) == [False, False]
    assert backend.batch_get_v1(None, idx) == []
    assert backend.batch_exists_v2(keys, [object()]).kv_hit_pages == 0
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=keys)]) == {
        PoolName.SWA: [False, False]
    }
    assert backend.set(keys[0]) is False
    assert backend.batch_get(keys, [1], [1, 2]) == 0

    # A sidecar that can't be registered after the attach is logged, not raised; its
    # transfers answer misses.
    class GpuPool:
        page_size = 1
        kv_buffer = torch.zeros(4, device="meta")

    backend.register_mem_host_pool_v2(GpuPool(), PoolName.MAMBA)
    assert PoolName.MAMBA not in backend.registered_pools
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.arange(2))
    assert backend.batch_set_v2([mamba]) == {PoolName.MAMBA: [False, False]}
    # A pool whose metadata fails (a bug anywhere below us) is still only a miss.
    pool.get_page_buffer_meta = lambda _idx: (_ for _ in ()).throw(RuntimeError("boom"))
    assert backend.batch_set_v1(keys, idx) == [False, False]
    assert backend.kvpool_stats()["guarded_errors"] >= 1


def test_pages_pushed_out_to_the_disk_tier_are_hits_and_load_back(
    start_kvpoold, tmp_path
):
    """The connector unchanged over a node with a disk tier: pages DRAM evicted still count as
    hits, and prefetch loads them back from disk, byte for byte."""
    d = start_kvpoold(
        memory="16MiB",
        extra=[
            "--disk-path",
            str(tmp_path / "disk"),
            "--disk-capacity",
            "256MiB",
            "--disk-region-size",
            "4MiB",
            "--disk-admit",
            "all",
        ],
    )
    page = 16
    pool = mha_pool("page_first", page, pages=6)
    backend = attach(storage_config(d.url, page_first=True), pool)
    keys = page_hashes(3, "disk-")
    src = pool.alloc(3 * page)
    assert backup(backend, keys, src, page)
    # Another tenant of the node fills DRAM twice over: the pages go down to disk.
    with kvpool.Client(d.url, timeout=20.0) as kv:
        filler = bytes(1 << 20)
        for i in range(32):
            kv.write(f"filler-{i}", filler)
        disk = kv.stats()["disk"]
    assert disk["demoted"] > 0, disk
    assert hit_pages(backend, keys) == 3
    dst = pool.alloc(3 * page)
    assert prefetch(backend, keys, dst, page) == 3
    assert same_pages(pool, src, pool, dst, 3, page)
    with kvpool.Client(d.url) as kv:
        assert kv.stats()["disk"]["promoted"] >= 3
    backend.close()

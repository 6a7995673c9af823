"""kvpool.vllm.KvpoolConnector across tensor-parallel layouts, with vllm 0.33.0's real scheduler
and KV tensors and a real kvpoold (the harness of ``_vllm_setup.py``).

Objects are keyed per group of ``heads_per_object`` KV heads (by the model-wide index of the
first), so a reader whose TP size differs from the writer's, with the same
``heads_per_object``, loads the heads it holds, byte for byte; an MLA latent, equal on every
rank, is one object per block, written by rank 0 and loaded by every rank.
"""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from conftest import in_ci

try:
    import _vllm_setup as base
    import torch
    from kvpool import Client
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
    )
except ImportError as e:  # pragma: no cover - the environment decides
    if in_ci():
        raise
    pytest.skip(
        f"vllm 0.33.0 is not installed ({e}): scripts/python-env",
        allow_module_level=True,
    )

BLOCK, KV_HEADS, LAYERS = base.BLOCK, base.KV_HEADS, base.LAYERS
# DeepSeek-V3's MLA latent: 512 + 64 rope dims, one "head", bf16.
MLA_HEAD = 576


@pytest.fixture
def models(tmp_path):
    return tmp_path


def tp_engine(
    path: str, url: str, tp: int, per_object: int | None = 4, **kw
) -> base.Engine:
    """An engine at TP size ``tp``: each rank's KV tensors hold its 8 / tp KV heads, stored
    ``per_object`` heads per object (None: the connector's default, all of a rank's)."""
    kcc = base.kv_cache_config(heads=KV_HEADS // tp)
    return base.Engine(path, url, tp=tp, kcc=kcc, heads_per_object=per_object, **kw)


def full_heads(e: base.Engine, block_ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the blocks' pages with every rank's heads in model order (dim 1)."""
    ranks = [e.pages(block_ids, r) for r in range(len(e.workers))]
    return [torch.cat(per_rank, dim=1) for per_rank in zip(*ranks)]


@pytest.mark.parametrize(("per_object", "staging"), [(4, False), (4, True), (1, False)])
def test_written_at_tp2_read_at_tp1_gives_every_head(
    kvpoold, models, per_object, staging
):
    """Prefill at TP 2 (two worker instances, 4 heads each), decode at TP 1, both storing
    ``per_object`` heads per object: the TP-1 reader's 8 heads equal the two writers' heads
    side by side, byte for byte; through host pages, and through staging as a device cache
    would."""
    path = base.model_dir(models, "llama3-8b")
    a = tp_engine(path, kvpoold.url, tp=2, per_object=per_object)
    if staging:
        a.use_staging()
    prompt = base.tokens(3 * BLOCK + 5, seed=21)
    saved = base.save_request_1(a, prompt)
    # Each object written once, by the rank that holds its heads.
    for w in a.workers:
        assert w.store.stats()["stores"] == 3 * (KV_HEADS // 2 // per_object)
    assert not torch.equal(a.pages(saved, 0)[0], a.pages(saved, 1)[0])
    b = tp_engine(path, kvpoold.url, tp=1, per_object=per_object)
    if staging:
        b.use_staging()
    b.add("r2", prompt)
    nr = b.wait_loaded("r2")
    assert nr.num_computed_tokens == 3 * BLOCK
    got = b.pages(nr.block_ids[0][:3])
    for want, have in zip(full_heads(a, saved), got):
        assert want.shape == have.shape and torch.equal(want, have)
    assert b.worker.store.stats()["hits"] == 3 * (KV_HEADS // per_object)
    a.close()
    b.close()


def test_without_the_same_heads_per_object_another_tp_size_misses(kvpoold, models):
    """By default an object holds all of a rank's heads, so a reader at another TP size names
    other keys: a miss, never another layout's bytes, until it sets the writer's
    ``heads_per_object``."""
    path = base.model_dir(models, "llama3-8b")
    a = tp_engine(path, kvpoold.url, tp=2, per_object=None)
    prompt = base.tokens(3 * BLOCK + 5, seed=24)
    base.save_request_1(a, prompt)
    assert a.workers[0].store.stats()["stores"] == 3  # one object per block and rank
    req = base.Request(
        "q", prompt, base.SamplingParams(max_tokens=1), None, block_hasher=base.HASHER
    )
    b = tp_engine(path, kvpoold.url, tp=2, per_object=None)
    assert b.conn.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    c = tp_engine(path, kvpoold.url, tp=1, per_object=None)  # 8 heads per object
    assert c.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    c.close()
    # The TP-2 writer's objects hold 4 heads: a TP-1 reader that says so reads them.
    c = tp_engine(path, kvpoold.url, tp=1, per_object=4)
    assert c.conn.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    c.close()
    a.close()
    b.close()


@pytest.mark.parametrize("staging", [False, True])
def test_written_at_tp1_read_at_tp2_gives_each_rank_its_heads(kvpoold, models, staging):
    """Prefill at TP 1, decode at TP 2: rank r loads heads 4r..4r+3 of what TP 1 wrote."""
    path = base.model_dir(models, "llama3-8b")
    a = tp_engine(path, kvpoold.url, tp=1)
    prompt = base.tokens(4 * BLOCK + 2, seed=22)
    saved = base.save_request_1(a, prompt)
    b = tp_engine(path, kvpoold.url, tp=2)
    if staging:
        b.use_staging()
    b.add("r2", prompt)
    nr = b.wait_loaded("r2")
    assert nr.num_computed_tokens == 4 * BLOCK
    ids = nr.block_ids[0][:4]
    half = KV_HEADS // 2
    for rank in (0, 1):
        for want, have in zip(a.pages(saved), b.pages(ids, rank)):
            assert torch.equal(want[:, rank * half : (rank + 1) * half], have)
        assert b.workers[rank].store.stats()["hits"] == 4  # one object of 4 heads
    # A head missing from the pool is a miss for the whole block, on every reader.
    req = base.Request(
        "q", prompt, base.SamplingParams(max_tokens=1), None, block_hasher=base.HASHER
    )
    cl = Client(kvpoold.url)
    assert cl.delete(b.workers[1].keys(req.block_hashes[2].hex())[0])  # heads 4..7
    cl.close()
    for tp in (1, 2):
        c = tp_engine(path, kvpoold.url, tp=tp)
        assert c.conn.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
        c.close()
    a.close()
    b.close()


def mla_config() -> KVCacheConfig:
    """32 MLA layers: one latent "head" of 576 bf16 per token, the same on every rank."""
    spec = MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=MLA_HEAD, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * base.NUM_BLOCKS * LAYERS,
        layers=list(base.LAYER_NAMES),
        layer_stride=page * base.NUM_BLOCKS,
        block_stride=page,
    )
    return KVCacheConfig(
        num_blocks=base.NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(base.LAYER_NAMES), spec)],
    )


def test_an_mla_latent_is_stored_once_and_every_rank_loads_it(kvpoold, models):
    """TP 2 on an MLA model: the two ranks hold the same latent, so rank 0 alone writes one
    object per block; every rank of a TP-2 reader, and a TP-1 reader, load it. Rank 1's cache
    is filled with other bytes here, so a copy written by rank 1 would show."""
    path = base.model_dir(models, "mla")
    a = base.Engine(path, kvpoold.url, tp=2, kcc=mla_config())
    prompt = base.tokens(3 * BLOCK + 9, seed=23)
    saved = base.save_request_1(a, prompt)
    w0, w1 = a.workers
    assert w0.object_bytes == LAYERS * BLOCK * MLA_HEAD * 2 == w1.object_bytes
    assert w0.store.stats()["stores"] == 3 and w1.store.stats()["stores"] == 0
    req = base.Request(
        "q", prompt, base.SamplingParams(max_tokens=1), None, block_hasher=base.HASHER
    )
    hashes = [h.hex() for h in req.block_hashes[:3]]
    assert [w0.keys(h) for h in hashes] == [w1.keys(h) for h in hashes]
    assert [len(w0.keys(h)) for h in hashes] == [1, 1, 1]
    assert w1.keys(hashes[0], writes=True) == []
    assert w0.store.presence([w0.key(h) for h in hashes]) == [True] * 3
    assert not torch.equal(a.pages(saved, 0)[0], a.pages(saved, 1)[0])
    for tp in (2, 1):
        b = base.Engine(path, kvpoold.url, tp=tp, kcc=mla_config())
        b.add("r2", prompt)
        nr = b.wait_loaded("r2")
        assert nr.num_computed_tokens == 3 * BLOCK
        for rank in range(tp):
            got = b.pages(nr.block_ids[0][:3], rank)
            for want, have in zip(a.pages(saved, 0), got):
                assert torch.equal(want, have)
        b.close()
    a.close()


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_context_parallelism_leaves_the_connector_idle(kvpoold, models, caplog, kind):
    """Under decode or prefill context parallelism a rank holds only some tokens of each
    block (and ranks sharing an MLA latent hold different ones), which the keys do not say:
    the connector neither looks up nor stores rather than mix them up."""
    path = base.model_dir(models, "mla")
    vc = base.vllm_config(path, kvpoold.url, tp=2)
    setattr(vc.parallel_config, f"{kind}_context_parallel_size", 2)
    caplog.set_level(logging.WARNING, logger="kvpool.vllm")
    conn = base.KvpoolConnector(vc, base.KVConnectorRole.SCHEDULER, mla_config())
    assert not conn.enabled
    assert any("context parallelism" in r.getMessage() for r in caplog.records)
    req = base.Request(
        "q",
        base.tokens(40, 26),
        base.SamplingParams(max_tokens=1),
        None,
        block_hasher=base.HASHER,
    )
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    w = base.KvpoolConnector(vc, base.KVConnectorRole.WORKER, mla_config())
    w.register_kv_caches(
        base.allocate_kv_cache(
            mla_config(), torch.device("cpu"), base.KVCacheLayout.LBHNC
        )
    )
    assert w.object_bytes == 0 and w._staging is None
    w.shutdown()
    conn.shutdown()

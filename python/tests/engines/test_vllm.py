"""kvpool.vllm.KvpoolConnector against vllm 0.33.0's real classes and a real kvpoold.

The scheduler role is driven by vLLM's own ``Scheduler`` running on the CPU: it loads the
connector through its factory from the documented ``--kv-transfer-config``, asks it for matches,
allocates blocks, builds the metadata and handles the connector's output. The worker role is
driven with exactly that metadata, in the model runner's order, on per-layer KV tensors allocated
by vLLM's own ``allocate_kv_cache`` and shaped like Llama-3-8B's (32 layers, 8 KV heads, head
128, bf16, 16-token blocks). What needs a GPU (the model runner, CUDA copies and graphs, TP in a
live engine) is listed in docs/ENGINES.md.
"""

from __future__ import annotations

import logging
import os
import pickle
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from conftest import in_ci

try:
    import torch
    from _vllm_setup import (
        BLOCK,
        HASHER,
        HEAD,
        KV_HEADS,
        LAYER_NAMES,
        LAYERS,
        Engine,
        KVCacheLayout,
        kv_cache_config,
        model_dir,
        save_request_1,
        tokens,
        vllm_config,
    )
    from kvpool import Client
    from kvpool.vllm import (
        KvpoolConnector,
        KvpoolConnectorMetadata,
        KvpoolConnectorStats,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.request import Request
except ImportError as e:  # pragma: no cover - the environment decides
    if in_ci():
        raise
    pytest.skip(
        f"vllm 0.33.0 is not installed ({e}): scripts/python-env",
        allow_module_level=True,
    )


@pytest.fixture
def models(tmp_path):
    return tmp_path


@pytest.mark.parametrize("same_host", [True, False])
def test_scheduler_saves_then_another_engine_loads_the_prefix_into_other_blocks(
    kvpoold, models, same_host
):
    """Saved by one engine, loaded by another into other block ids: on kvpoold's host from
    its memory, and over TCP straight from the socket into the pages (both without staging)."""
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url, same_host=same_host)
    # 5 full blocks and a partial one: the partial block is never stored.
    prompt1 = tokens(5 * BLOCK + 8, seed=1)
    saved_ids = save_request_1(a, prompt1)
    assert len(saved_ids) == 5
    # One object per block (all the rank's KV heads by default): 2 MiB.
    assert a.worker.object_bytes == LAYERS * 2 * BLOCK * KV_HEADS * HEAD * 2
    assert a.worker.stored_object_bytes == a.worker.object_bytes
    assert set(a.worker.block_strides.values()) == {2 * BLOCK * KV_HEADS * HEAD * 2}
    s = a.worker.store.stats()
    assert s["stores"] == 5 and s["bytes_written"] == 5 * a.worker.object_bytes
    assert a.sched.requests.get("r1") is None  # finished and freed, nothing held

    # Engine B: another scheduler and worker, same model. A filler request takes blocks first,
    # so request 2's prefix lands in other block ids than request 1's.
    b = Engine(path, kvpoold.url, same_host=same_host)
    assert b.worker.store.is_local is same_host
    scattered = []  # blocks loaded straight into the pages (no staging slot)
    direct = b.worker.store.load_scattered
    b.worker.store.load_scattered = lambda keys, pieces: (
        scattered.append(len(keys)) or direct(keys, pieces)
    )
    b.add("filler", tokens(5 * BLOCK, seed=9), max_tokens=8)
    b.step(fill_seed=3)
    prompt2 = prompt1[: 5 * BLOCK] + tokens(20, seed=2)
    b.add("r2", prompt2)
    out, _ = b.step(fill_seed=4)
    meta = out.kv_connector_metadata
    # vLLM pickles the metadata to its worker processes, and the stats back.
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert [j.req_id for j in meta.loads] == ["r2"]
    load = meta.loads[0]
    assert len(load.block_ids) == 5
    assert set(load.block_ids).isdisjoint(saved_ids), (load.block_ids, saved_ids)
    assert load.hashes == [h.hex() for h in b.sched.requests["r2"].block_hashes[:5]]
    nr = b.wait_loaded("r2")
    # The real scheduler took the load: 80 tokens computed, 20 left to prefill.
    assert nr.num_computed_tokens == 5 * BLOCK
    assert nr.block_ids[0][:5] == load.block_ids
    for pa, pb in zip(a.pages(saved_ids), b.pages(load.block_ids)):
        assert torch.equal(pa, pb)
    s = b.worker.store.stats()
    assert s["hits"] == 5 and s["misses"] == 0 and s["errors"] == 0
    assert sum(scattered) == 5
    # r2's one new full block (index 5) was saved after its prefill; the loaded ones were not.
    assert b.worker.store.stats()["stores"] == 1 + 5  # r2's block 5 + the filler's 5
    a.close()
    b.close()


def test_the_object_is_layout_independent(kvpoold, models):
    """A block saved from a layer-outermost cache loads into a block-outermost one."""
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url, KVCacheLayout.LBHNC)
    prompt = tokens(3 * BLOCK + 1, seed=5)
    saved = save_request_1(a, prompt)
    b = Engine(path, kvpoold.url, KVCacheLayout.BLHNC)
    b.add("r2", prompt)
    nr = b.wait_loaded("r2")
    assert nr.num_computed_tokens == 3 * BLOCK
    for pa, pb in zip(a.pages(saved), b.pages(nr.block_ids[0][:3])):
        assert torch.equal(pa, pb)
    a.close()
    b.close()


def test_synchronous_loads_are_in_place_before_the_forward(kvpoold, models):
    """With ``load_async: false`` vLLM schedules the request in the step that loads it, calls
    start_load_kv before the forward, which returns only once the blocks are in place."""
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url)
    prompt = tokens(4 * BLOCK + 5, seed=13)
    saved = save_request_1(a, prompt)
    b = Engine(path, kvpoold.url, load_async=False)
    b.add("r2", prompt)
    seen = {}

    def check(meta):
        seen["loads"] = list(meta.loads)

    def loaded_before_forward(out, rank):
        ids = out.scheduled_new_reqs[0].block_ids[0][:4]
        seen["equal"] = all(
            torch.equal(pa, pb) for pa, pb in zip(a.pages(saved), b.pages(ids))
        )

    out, kvo = b.step(before_worker=check, before_forward=loaded_before_forward)
    assert out.has_sync_kv_loads and len(seen["loads"]) == 1
    nr = next(r for r in out.scheduled_new_reqs if r.req_id == "r2")
    assert nr.num_computed_tokens == 4 * BLOCK  # scheduled at once, 5 tokens to prefill
    assert nr.block_ids[0][:4] == seen["loads"][0].block_ids
    assert kvo.invalid_block_ids == set() and kvo.finished_recving is None
    assert seen["equal"]
    a.close()
    b.close()


def test_a_failed_synchronous_load_saves_nothing_computed_over_it(kvpoold, models):
    """Block 1 of a synchronous load is gone: vLLM recomputes from it, and the blocks this
    step computed over the missing one are not stored; once recomputed, they are."""
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url)
    prompt1 = tokens(3 * BLOCK + 1, seed=17)
    save_request_1(a, prompt1)
    b = Engine(path, kvpoold.url, load_async=False)
    prompt2 = prompt1[: 3 * BLOCK] + tokens(2 * BLOCK + 3, seed=18)
    req = b.add("r2", prompt2)
    keys = [b.worker.key(h.hex()) for h in req.block_hashes]

    def evict(meta):
        cl = Client(kvpoold.url)
        assert cl.delete(keys[1])
        cl.close()

    out, kvo = b.step(before_worker=evict, fill_seed=6)
    load = out.kv_connector_metadata.loads[0]
    assert kvo.invalid_block_ids == {load.block_ids[1]}
    # The step computed blocks 3 and 4 over the missing block 1: none of them was stored.
    assert [j.block_ids for j in out.kv_connector_metadata.saves] == [
        out.scheduled_new_reqs[0].block_ids[0][3:5]
    ]
    assert b.worker.store.presence(keys) == [True, False, True, False, False]
    out, kvo = b.step(fill_seed=7)  # vLLM recomputes from block 1 ...
    nr = out.scheduled_cached_reqs
    assert nr.req_ids == ["r2"] and nr.num_computed_tokens == [BLOCK]
    assert b.worker.store.presence(keys) == [True] * 5  # ... and those blocks are saved
    a.close()
    b.close()


def test_tensor_parallel_ranks_store_their_own_objects_and_a_hit_needs_every_rank(
    kvpoold, models
):
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url, tp=2)
    prompt = tokens(3 * BLOCK + 7, seed=14)
    saved = save_request_1(a, prompt)
    assert a.workers[0].key("00") != a.workers[1].key("00")
    b = Engine(path, kvpoold.url, tp=2)
    b.add("r2", prompt)
    nr = b.wait_loaded("r2")
    assert nr.num_computed_tokens == 3 * BLOCK
    for rank in (0, 1):  # each rank got its own shard back
        for pa, pb in zip(a.pages(saved, rank), b.pages(nr.block_ids[0][:3], rank)):
            assert torch.equal(pa, pb)
    assert not torch.equal(a.pages(saved, 0)[0], a.pages(saved, 1)[0])
    # Rank 1 lost block 1: only block 0 is whole for every rank.
    req = Request("q", prompt, SamplingParams(max_tokens=1), None, block_hasher=HASHER)
    cl = Client(kvpoold.url)
    assert cl.delete(b.workers[1].key(req.block_hashes[1].hex()))
    cl.close()
    c = Engine(path, kvpoold.url, tp=2)
    assert c.conn.get_num_new_matched_tokens(req, 0) == (BLOCK, True)
    for e in (a, b, c):
        e.close()


def test_full_prompt_hit_backs_off_one_block_and_lookups_are_cached(kvpoold, models):
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url)
    prompt = tokens(4 * BLOCK, seed=6)  # exactly 4 full blocks
    save_request_1(a, prompt)
    b = Engine(path, kvpoold.url)
    req = Request("q", prompt, SamplingParams(max_tokens=2), None, block_hasher=HASHER)
    lookups = b.conn.store.stats()["lookups"]
    # 4 blocks stored, but one token must be computed: 3 blocks are offered.
    assert b.conn.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    assert b.conn.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    assert b.conn.get_num_new_matched_tokens(req, BLOCK) == (2 * BLOCK, True)
    # One match_prefix per (request, local hit), however often vLLM asks.
    assert b.conn.store.stats()["lookups"] == lookups + 2
    assert b.conn.get_num_new_matched_tokens(req, 3 * BLOCK) == (0, False)
    a.close()
    b.close()


def test_another_model_never_matches(kvpoold, models):
    a = Engine(model_dir(models, "llama3-8b"), kvpoold.url)
    prompt = tokens(4 * BLOCK + 3, seed=7)
    save_request_1(a, prompt)
    req = Request("x", prompt, SamplingParams(max_tokens=2), None, block_hasher=HASHER)
    assert a.conn.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)
    other_vc = vllm_config(model_dir(models, "llama3-8b-finetune"), kvpoold.url)
    other = KVConnectorFactory.create_connector(
        other_vc, KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    assert other.get_num_new_matched_tokens(req, 0) == (0, False)
    # Same model, other TP layout: other keys too (unless both set heads_per_object).
    assert other.salt(0, 0) != a.conn.salt(0, 0) != a.conn.salt(1, 0)
    other.shutdown()
    a.close()


def test_evicted_blocks_and_a_killed_daemon_are_recomputed_exactly(kvpoold, models):
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url)
    prompt = tokens(5 * BLOCK + 4, seed=8)
    save_request_1(a, prompt)
    # Blocks 2 and 4 vanish between the lookup and the load (evicted, say).
    b = Engine(path, kvpoold.url)
    b.add("r2", prompt)
    loads = []

    def evict(meta):
        loads.extend(meta.loads)
        cl = Client(kvpoold.url)
        for i in (2, 4):
            assert cl.delete(b.worker.key(meta.loads[0].hashes[i]))
        cl.close()

    out, kvo = b.step(before_worker=evict)
    load = loads[0]
    assert len(load.block_ids) == 5
    failed: set[int] = set(kvo.invalid_block_ids)

    for _ in range(20):
        out, kvo = b.step()
        failed |= kvo.invalid_block_ids
        nr = next((r for r in out.scheduled_new_reqs if r.req_id == "r2"), None)
        if nr:
            break
        time.sleep(0.01)
    assert failed == {load.block_ids[2], load.block_ids[4]}
    # vLLM kept the two good leading blocks and recomputes from the first failed one.
    assert nr is not None and nr.num_computed_tokens == 2 * BLOCK
    assert b.worker.store.stats()["misses"] == 2

    # kvpoold dies after the scheduler matched: every block of the load fails, none raises.
    c = Engine(path, kvpoold.url)
    c.add("r3", prompt)
    loads.clear()

    def kill(meta):
        loads.extend(meta.loads)
        kvpoold.kill()

    out, kvo = c.step(before_worker=kill)
    load = loads[0]
    failed = set(kvo.invalid_block_ids)
    nr = None
    for _ in range(20):
        out, kvo = c.step()
        failed |= kvo.invalid_block_ids
        nr = next((r for r in out.scheduled_new_reqs if r.req_id == "r3"), None)
        if nr:
            break
    assert failed == set(load.block_ids)
    assert nr is not None and nr.num_computed_tokens == 0
    # Lookups and saves with the daemon gone are misses, not exceptions.
    req = Request("y", prompt, SamplingParams(max_tokens=1), None, block_hasher=HASHER)
    assert c.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    c.add("r4", tokens(3 * BLOCK, seed=11), max_tokens=1)
    c.step(fill_seed=5)
    st = c.worker.store.stats()
    assert st["errors"] >= 1 and st["stores"] == 0
    for e in (a, b, c):
        e.close()


def test_stats_aggregate_and_reduce_through_vllms_logger(kvpoold, models):
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url)
    prompt = tokens(3 * BLOCK + 2, seed=12)
    a.add("r1", prompt, max_tokens=1)
    _, kvo_a = a.step(fill_seed=1)
    b = Engine(path, kvpoold.url)
    b.add("r2", prompt)
    stats = []
    for _ in range(20):
        out, kvo = b.step()
        if kvo.kv_connector_stats is not None:
            stats.append(kvo.kv_connector_stats)
        if any(r.req_id == "r2" for r in out.scheduled_new_reqs):
            break
    sa = kvo_a.kv_connector_stats
    assert isinstance(sa, KvpoolConnectorStats)
    assert pickle.loads(pickle.dumps(sa)) == sa
    assert (
        sa.data["stores"] == 3 and sa.data["bytes_written"] == 3 * a.worker.object_bytes
    )
    total = KvpoolConnector.build_kv_connector_stats(dict(sa.data))
    for s in stats:
        total = total.aggregate(s)
    r = total.reduce()
    assert r["stores"] == 3 and r["hits"] == 3 and r["misses"] == 0
    assert r["bytes_read"] == 3 * b.worker.object_bytes and r["loads"] == 1
    assert r["hit_rate"] == 1.0 and r["avg_load_ms"] > 0
    # The scheduler side counts its lookups.
    b.conn.get_kv_connector_stats()  # what vLLM's scheduler already took
    req = Request("s", prompt, SamplingParams(max_tokens=1), None, block_hasher=HASHER)
    b.conn.get_num_new_matched_tokens(req, 0)
    sched_stats = b.conn.get_kv_connector_stats()
    assert sched_stats is not None and sched_stats.data["lookups"] == 1
    # vLLM's own logger builds our class from the workers' dicts and logs the reduction.
    logging_ = KVConnectorLogging(b.conn._kv_transfer_config)
    logging_.observe(dict(total.data))
    lines: list[str] = []
    logging_.log(lambda fmt, s: lines.append(fmt % s))
    assert lines and "hits=3" in lines[0]
    assert KvpoolConnector.build_kv_connector_stats({}).is_empty()
    # And vLLM's Prometheus logger, through the connector's build_prom_metrics, exports them.
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    prom = KVConnectorProm(
        b.conn._vllm_config, ["model_name", "engine"], {0: ["llama", "0"]}
    )
    prom.observe(dict(total.data), 0)
    labels = {"model_name": "llama", "engine": "0"}

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert sample("vllm:kvpool_hit_blocks_total") == 3
    assert sample("vllm:kvpool_stored_blocks_total") == 3
    assert sample("vllm:kvpool_read_bytes_total") == 3 * b.worker.object_bytes
    assert sample("vllm:kvpool_loads_total") == 1
    assert sample("vllm:kvpool_load_seconds_total") > 0
    a.close()
    b.close()


def test_a_random_per_process_hash_is_never_stored(
    kvpoold, models, caplog, monkeypatch
):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vc = vllm_config(model_dir(models, "llama3-8b"), kvpoold.url)
    vc.cache_config.prefix_caching_hash_algo = "xxhash"
    caplog.set_level(logging.WARNING, logger="kvpool.vllm")
    conn = KvpoolConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert not conn.enabled
    assert sum("PYTHONHASHSEED" in r.getMessage() for r in caplog.records) == 1
    req = Request(
        "z", tokens(40, 1), SamplingParams(max_tokens=1), None, block_hasher=HASHER
    )
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.shutdown()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    conn = KvpoolConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert conn.enabled
    conn.shutdown()


def test_hma_stays_on_and_a_group_it_cannot_store_leaves_the_connector_idle(
    kvpoold, models, caplog
):
    """The connector declares SupportsHMA: vLLM keeps its hybrid KV cache manager on, also
    when it is asked for explicitly. Handed a group whose state it does not store (Mamba
    outside vLLM's ``align`` cache mode, which keeps no state at block boundaries), it stays
    idle: a hit must restore every group."""
    from vllm.v1.kv_cache_interface import MambaSpec

    path = model_dir(models, "llama3-8b")
    vc = vllm_config(path, kvpoold.url)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(vc.kv_transfer_config)
    kcc = kv_cache_config()
    half = len(LAYER_NAMES) // 2
    spec = kcc.kv_cache_groups[0].kv_cache_spec
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2
    )
    kcc.kv_cache_groups = [
        KVCacheGroupSpec(LAYER_NAMES[:half], spec),
        KVCacheGroupSpec(LAYER_NAMES[half:], mamba),
    ]
    caplog.set_level(logging.WARNING, logger="kvpool.vllm")
    conn = KvpoolConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert not conn.enabled
    assert any("MambaSpec" in r.getMessage() for r in caplog.records)
    req = Request(
        "g", tokens(40, 3), SamplingParams(max_tokens=1), None, block_hasher=HASHER
    )
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.request_finished_all_groups(req, ([1], [2])) == (False, None)
    conn.shutdown()


def test_no_exception_escapes_and_a_worker_without_staging_fails_its_loads(
    kvpoold, models
):
    path = model_dir(models, "llama3-8b")
    a = Engine(path, kvpoold.url)
    prompt = tokens(3 * BLOCK + 2, seed=15)
    save_request_1(a, prompt)
    # Garbage in: every method answers its miss value.
    conn = a.conn
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert conn.update_state_after_alloc(object(), None, 16) is None
    assert isinstance(conn.build_connector_meta(object()), KvpoolConnectorMetadata)
    assert conn.request_finished(object(), [1]) == (False, None)
    w = KVConnectorFactory.create_connector(
        vllm_config(path, kvpoold.url), KVConnectorRole.WORKER, kv_cache_config()
    )
    w.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(3)})
    assert w.object_bytes == 0  # refused: not vLLM's paged layout
    # A load handed to that worker: every block fails, the request still finishes.
    b = Engine(path, kvpoold.url)
    b.add("r2", prompt)
    out = b.sched.schedule()
    meta = out.kv_connector_metadata
    load = meta.loads[0]
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    assert w.get_finished(set()) == (None, {"r2"})
    assert w.get_block_ids_with_load_errors() == set(load.block_ids)
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    assert w.get_kv_connector_stats().data["load_failed_blocks"] == 3
    w.clear_connector_metadata()
    w.shutdown()
    for e in (a, b):
        e.close()


def test_a_save_that_finds_no_staging_slot_is_dropped_not_waited_for(kvpoold, models):
    path = model_dir(models, "llama3-8b")
    e = Engine(path, kvpoold.url, staging_blocks=2, io_timeout=0.2)
    held = e.worker._take_slots(2, None)  # the saver is busy with two slow blocks, say
    e.add("r1", tokens(3 * BLOCK, seed=16), max_tokens=1)
    out = e.sched.schedule()
    e.worker.bind_connector_metadata(out.kv_connector_metadata)
    e.worker.wait_for_save()  # gives up after io_timeout (0.2 s)
    e.worker._give_slots(held)
    assert e.worker.flush(5.0)
    st = e.worker.get_kv_connector_stats()
    assert st.data["save_dropped_blocks"] == 3 and st.data["stores"] == 0
    e.worker.clear_connector_metadata()
    e.close()

"""kvpool.vllm_offload.KvpoolTier as a secondary tier of vllm 0.33.0's own OffloadingConnector,
against vLLM's real classes and a real kvpoold.

The scheduler role is vLLM's own ``Scheduler`` on the CPU, with the ``OffloadingConnector``
that its factory builds from the documented ``--kv-transfer-config``: vLLM's
``TieringOffloadingSpec``, its ``TieringOffloadingManager``, its CPU tier in a real shared-memory
region, its async lookups, and kvpool's tier loaded by vLLM's ``SecondaryTierFactory`` from its
module path. The worker role is vLLM's worker-side connector, driven in the model runner's
order, on per-layer KV tensors from vLLM's ``allocate_kv_cache`` shaped like Llama-3-8B's (32
layers, 8 KV heads, head 128, bf16, 16-token blocks). The one piece that needs a GPU, vLLM's
``CPUOffloadingWorker`` (CUDA copies between the GPU cache and the CPU tier), is replaced by
``kvpool._vllm_offload_host.HostCopyWorker``: the same calls and layout, done with memmoves.
"""

from __future__ import annotations

import json
import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from conftest import in_ci

try:
    import torch
    from _vllm_setup import (
        BLOCK,
        HEAD,
        KV_HEADS,
        LAYER_NAMES,
        LAYERS,
        engine_config,
        kv_cache_config,
        model_dir,
        model_output,
        request,
        scheduler,
        tokens,
    )
    from kvpool import Client
    from kvpool._vllm_offload_host import use_host_copies
    from kvpool.vllm_offload import KvpoolTier, offload_salt
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from vllm.v1.worker.utils import allocate_kv_cache
except ImportError as e:  # pragma: no cover - the environment decides
    if in_ci():
        raise
    pytest.skip(
        f"vllm 0.33.0 is not installed ({e}): scripts/python-env",
        allow_module_level=True,
    )

CHUNK = LAYERS * 2 * BLOCK * KV_HEADS * HEAD * 2  # one block of every layer: 2 MiB
# The --kv-transfer-config of docs/ENGINES.md, byte for byte.
LAUNCH = (
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",'
    '"cpu_bytes_to_use":8589934592,"secondary_tiers":[{"type":"KvpoolTier",'
    '"module_path":"kvpool.vllm_offload","kvpool_url":"tcp://127.0.0.1:7070"}]}}'
)


def vllm_config(path: str, url: str, cpu_chunks: int, **tier) -> VllmConfig:
    """What ``vllm serve PATH --kv-transfer-config '{...}'`` builds, with a CPU tier of
    ``cpu_chunks`` chunks and the tier entry's settings updated by ``tier``."""
    launch = json.loads(LAUNCH.replace("tcp://127.0.0.1:7070", url))
    extra = launch["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = cpu_chunks * CHUNK
    extra["secondary_tiers"][0].update({"lookup_timeout": 2.0}, **tier)
    return engine_config(path, KVTransferConfig(**launch))


class Engine:
    """vLLM's real scheduler with the OffloadingConnector, and one worker-role connector on its
    own CPU KV tensors (what the GPU would hold), sharing the engine's CPU tier."""

    def __init__(self, path: str, url: str, cpu_chunks: int = 8, **tier):
        kcc = kv_cache_config()
        vc = vllm_config(path, url, cpu_chunks, **tier)
        self.sched = scheduler(vc, kcc)
        self.conn = self.sched.connector
        self.manager = self.conn.connector_scheduler.manager
        assert isinstance(self.manager, TieringOffloadingManager)
        (self.tier,) = self.manager.secondary_tiers
        self.worker = KVConnectorFactory.create_connector(
            vc, KVConnectorRole.WORKER, kcc
        )
        use_host_copies(self.worker)
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker.register_kv_caches(self.kv)
        self.recving: set[str] = set()

    def add(self, rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
        req = request(rid, tokens, max_tokens)
        self.sched.add_request(req)
        return req

    def step(self):
        """One engine step: schedule; the worker's connector calls in the model runner's order
        around a "forward" that writes random KV into the blocks of the new requests' computed
        tokens; the output fed back to the scheduler. Returns the scheduler output."""
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in LAYER_NAMES:
            self.forward_layer(out, name)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(set(out.finished_req_ids))
        self.recving |= res.finished_recving or set()
        kvo = KVConnectorOutput(
            finished_recving=res.finished_recving or None,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        self.sched.update_from_output(out, model_output(out, kvo))
        return out

    def forward_layer(self, out, name: str) -> None:
        """Writes KV into the blocks of this step's new tokens (the attention kernel's cache
        write; whole blocks, which is all the offloading path reads)."""
        t = self.kv[name]
        for nr in out.scheduled_new_reqs:
            seed = sum(map(ord, nr.req_id)) * 1000 + LAYER_NAMES.index(name)
            g = torch.Generator().manual_seed(seed)
            for b in nr.block_ids[0][nr.num_computed_tokens // BLOCK :]:
                t[b] = torch.randn(t.shape[1:], generator=g).to(t.dtype)

    def settle(self, steps: int = 200) -> None:
        """Steps until no transfer is left: stores deferred to the next step, cascades to
        kvpool, promotions."""
        for _ in range(steps):
            self.step()
            if (
                not self.conn.has_pending_push_work()
                and not self.manager.has_pending_work()
            ):
                return
            time.sleep(0.005)
        raise AssertionError("transfers never finished")

    def run_until_scheduled(self, rid: str, steps: int = 200):
        """Steps until the request is scheduled; returns its NewRequestData."""
        for _ in range(steps):
            out = self.step()
            for nr in out.scheduled_new_reqs:
                if nr.req_id == rid:
                    return nr
            time.sleep(0.005)
        raise AssertionError(f"{rid} was never scheduled")

    def pages(self, block_ids: list[int]) -> list[torch.Tensor]:
        idx = torch.tensor(block_ids)
        return [self.kv[n].index_select(0, idx).view(torch.int16) for n in LAYER_NAMES]

    def row(self, block_id: int) -> bytes:
        """The chunk row the CPU tier holds for a block: every layer's page, in layer order."""
        return b"".join(
            self.kv[n][block_id].contiguous().view(torch.uint8).numpy().tobytes()
            for n in LAYER_NAMES
        )

    def close(self) -> None:
        self.worker.shutdown()
        self.conn.shutdown()


@pytest.fixture
def engine():
    """A factory of :class:`Engine` (same arguments); every engine made is closed when the test
    ends, passed or failed, so its CPU tier's shared-memory file goes too."""
    made: list[Engine] = []

    def make(*args, **kwargs) -> Engine:
        e = Engine(*args, **kwargs)
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        e.close()


def written_through(engine: Engine, prompt: list[int], rid: str = "r1") -> list[int]:
    """Runs one request over ``prompt`` (KV filled with random values) and steps until its
    full blocks are in the CPU tier and in kvpool; returns their block ids."""
    req = engine.add(rid, prompt)
    nr = engine.run_until_scheduled(rid)
    engine.settle()
    assert len(req.block_hashes) == len(prompt) // BLOCK
    return nr.block_ids[0][: len(prompt) // BLOCK]


def keys_of(engine: Engine, req_tokens: list[int]) -> list[str]:
    req = request("k", req_tokens)
    return [engine.tier.key(make_offload_key(h, 0)) for h in req.block_hashes]


def test_the_launch_line_loads_the_tier_through_vllms_factory(
    kvpoold, tmp_path, engine
):
    """The documented --kv-transfer-config gives vLLM's OffloadingConnector with kvpool as its
    secondary tier, built by vLLM's own factories; bad tier settings fail at start."""
    path = model_dir(tmp_path, "llama3-8b")
    e = engine(
        path, kvpoold.url, backpressure={"backpressure_cls": "EMABackpressureDetector"}
    )
    assert type(e.conn).__name__ == "OffloadingConnector"
    assert isinstance(e.tier, KvpoolTier) and e.tier.tier_type == "KvpoolTier"
    assert e.tier.block_size_bytes == CHUNK  # one row: one block of all 32 layers
    assert e.tier.store.is_local and e.tier.bp_detector is not None
    assert e.manager.config_info()[1]["kvpool_url"] == kvpoold.url
    with pytest.raises(ValueError, match="unknown settings"):
        engine(path, kvpoold.url, kvpool_urll="tcp://x")
    with pytest.raises(ValueError, match="positive"):
        engine(path, kvpoold.url, io_timeout=0)


@pytest.mark.parametrize("same_host", [True, False])
def test_written_through_chunks_load_into_another_engine(
    kvpoold, tmp_path, engine, same_host
):
    """Engine A's chunks reach kvpool through its CPU tier, byte for byte; engine B finds them
    through vLLM's real offloading manager (lookup, promotion into its CPU tier, load into its
    KV cache) and loads them into other block ids: from kvpoold's memory on its host, from
    the socket over TCP."""
    path = model_dir(tmp_path, "llama3-8b")
    a = engine(path, kvpoold.url, same_host=same_host)
    prompt = tokens(5 * BLOCK + 8, seed=1)
    saved = written_through(a, prompt)
    keys = keys_of(a, prompt)
    c = Client(kvpoold.url)
    assert [c.read(k) for k in keys] == [a.row(b) for b in saved]
    s = a.tier.stats()
    assert s["stores"] == 5 and s["bytes_written"] == 5 * CHUNK and s["errors"] == 0

    b = engine(path, kvpoold.url, cpu_chunks=16, same_host=same_host)
    assert b.tier.store.is_local is same_host
    b.add("filler", tokens(5 * BLOCK, seed=9), max_tokens=8)
    b.run_until_scheduled("filler")
    b.add("r2", prompt[: 5 * BLOCK] + tokens(20, seed=2))
    nr = b.run_until_scheduled("r2")
    assert nr.num_computed_tokens == 5 * BLOCK  # 80 tokens loaded, 20 left to prefill
    loaded = nr.block_ids[0][:5]
    assert set(loaded).isdisjoint(saved) and "r2" in b.recving
    for pa, pb in zip(a.pages(saved), b.pages(loaded)):
        assert torch.equal(pa, pb)
    s = b.tier.stats()
    assert s["hits"] == 5 and s["misses"] == 0 and s["bytes_read"] == 5 * CHUNK
    b.settle()
    # r2's one new full block went through; the five it loaded were not sent again.
    assert b.tier.stats()["stores"] == 1 + 5  # r2's block 5 + the filler's 5


def test_chunks_the_cpu_tier_evicted_come_back_from_kvpool(kvpoold, tmp_path, engine):
    """A CPU tier of 4 chunks: the chunks of a second request evict the first request's from
    it; kvpool still holds them, and the same engine loads them back from there."""
    path = model_dir(tmp_path, "llama3-8b")
    e = engine(path, kvpoold.url, cpu_chunks=4)
    first = tokens(4 * BLOCK + 1, seed=3)
    saved = written_through(e, first, "r1")
    ref = e.pages(saved)
    written_through(e, tokens(4 * BLOCK + 1, seed=4), "r2")
    lookup, probe = e.manager.primary_tier.lookup, ReqContext("probe")
    req = e.add("r3", first)
    in_cpu = [lookup(make_offload_key(h, 0), probe).name for h in req.block_hashes]
    assert in_cpu == ["MISS"] * 4, in_cpu  # evicted from vLLM's CPU tier
    assert e.sched.reset_prefix_cache()  # and gone from the GPU cache
    for n in LAYER_NAMES:
        e.kv[n].zero_()
    nr = e.run_until_scheduled("r3")
    assert nr.num_computed_tokens == 4 * BLOCK
    for pa, pb in zip(ref, e.pages(nr.block_ids[0][:4])):
        assert torch.equal(pa, pb)
    assert e.tier.stats()["hits"] == 4


def test_a_killed_kvpoold_gives_misses_not_exceptions(start_kvpoold, tmp_path, engine):
    """kvpoold killed during a promotion, then down for lookups and stores: the request is
    recomputed, stores fail as jobs (which vLLM's back-pressure detector counts), nothing
    raises into vLLM."""
    d = start_kvpoold()
    path = model_dir(tmp_path, "llama3-8b")
    a = engine(path, d.url)
    prompt = tokens(3 * BLOCK + 1, seed=5)
    written_through(a, prompt)
    b = engine(
        path,
        d.url,
        failure_threshold=1,
        backpressure={
            "backpressure_cls": "EMABackpressureDetector",
            "failure_threshold": 1,
        },
    )
    load = b.tier._io.load

    def kill_then_load(*args):
        d.kill()
        load(*args)

    b.tier._io.load = kill_then_load
    b.add("r2", prompt)
    nr = b.run_until_scheduled("r2")
    assert (
        nr.num_computed_tokens == 0
    )  # the promotion failed: vLLM recomputes everything
    s = b.tier.stats()
    assert s["hits"] == 0 and s["misses"] == 3
    b.settle()  # r2's three blocks: the write-through fails
    assert b.tier.stats()["stores"] == 0 and b.tier.bp_detector.is_under_pressure()
    b.add("r3", tokens(2 * BLOCK + 1, seed=6))
    nr = b.run_until_scheduled("r3")
    assert nr.num_computed_tokens == 0
    b.settle()
    assert not b.tier.stats()["available"]  # the breaker answers at once


def test_another_model_or_layout_never_matches(kvpoold, tmp_path, engine):
    """Another model (another name, same shapes) finds nothing of the first one's chunks; the
    salt changes with the model id, the dtype and the row layout."""
    a = engine(model_dir(tmp_path, "llama3-8b"), kvpoold.url)
    prompt = tokens(3 * BLOCK + 1, seed=7)
    written_through(a, prompt)
    b = engine(model_dir(tmp_path, "other-model"), kvpoold.url)
    assert b.tier.salt != a.tier.salt
    b.add("r2", prompt)
    nr = b.run_until_scheduled("r2")
    assert nr.num_computed_tokens == 0 and b.tier.stats()["hits"] == 0
    spec = a.tier._offloading_spec
    salts = {
        offload_salt(spec, CHUNK, None),
        offload_salt(spec, CHUNK, "another-id"),
        offload_salt(spec, CHUNK + 4096, None),
    }
    assert len(salts) == 3 and a.tier.salt in salts


def test_random_per_process_hashes_are_neither_looked_up_nor_stored(
    kvpoold, tmp_path, monkeypatch, engine
):
    """vLLM seeds its block hashes at random per process (a non-cryptographic hash without
    PYTHONHASHSEED): no other process could reuse them, so the tier stays idle. It decides
    once vLLM has seeded them, which vLLM's engine core does after building the scheduler."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(
        "kvpool.vllm_offload.get_none_hash_seed", lambda: "a random per-process seed"
    )
    e = engine(model_dir(tmp_path, "llama3-8b"), kvpoold.url)
    with (
        monkeypatch.context() as m
    ):  # vLLM seeds its hashes after building the scheduler
        m.delattr(kv_cache_utils, "NONE_HASH")
        assert not e.tier.enabled and e.tier._shareable is None  # not decided yet
    assert not e.tier.enabled and e.tier._shareable is False
    prompt = tokens(3 * BLOCK + 1, seed=8)
    written_through(e, prompt)
    assert Client(kvpoold.url).batch_exists(keys_of(e, prompt)) == [False] * 3
    s = e.tier.stats()
    assert s["lookups"] == 0 and s["stores"] == 0

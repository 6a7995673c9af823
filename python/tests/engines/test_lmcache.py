"""kvpool.lmcache against a real kvpoold, driven by LMCache's own (0.5.6) classes.

The config is a real ``LMCacheEngineConfig`` read from the YAML that docs/ENGINES.md gives;
LMCache's ``CreateStorageBackends`` builds the real ``LocalCPUBackend`` (its CPU arena) and, from
``remote_storage_plugins: ["kvpool"]``, a real ``RemoteBackend`` whose ``ConnectorManager``
imports ``kvpool.lmcache`` and asks ``KvpoolConnectorAdapter`` for the connector. The chunks are
``MemoryObj``\\ s allocated by that backend, shaped like Llama-3-8B (KV_2LTD: 2 × 32 layers × 256
tokens × 8 heads × 128, bf16: 32 MiB a chunk) and like DeepSeek's MLA (1 × 61 layers × 256 tokens
× 576, bf16). Bytes are compared exactly."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import in_ci

try:
    import torch
    from kvpool.lmcache import (
        KvpoolConnectorAdapter,
        KvpoolRemoteConnector,
        endpoint_of,
    )
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends
    from lmcache.v1.storage_backend.connector import (
        ConnectorManager,
        CreateConnector,
    )
except ImportError as e:  # the engines venv is missing (scripts/python-env builds it)
    if in_ci():
        raise
    pytest.skip(f"LMCache is not installed: {e}", allow_module_level=True)

LLAMA = "meta-llama/Meta-Llama-3-8B"
LLAMA_SHAPE = (
    32,
    2,
    256,
    8,
    128,
)  # LMCache's kv_shape: layers, K/V, chunk, heads, head dim
DEEPSEEK = "deepseek-ai/DeepSeek-V3"
MLA_SHAPE = (61, 1, 256, 1, 576)

CONFIG_YAML = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: {cpu_gb}
remote_storage_plugins: ["kvpool"]
extra_config:
  remote_storage_plugin.kvpool.module_path: kvpool.lmcache
  remote_storage_plugin.kvpool.class_name: KvpoolConnectorAdapter
  remote_storage_plugin.kvpool.url: "kvpool://{addr}"
  remote_storage_plugin.kvpool.lookup_timeout_ms: 2000
  remote_storage_plugin.kvpool.io_timeout_ms: 5000
  remote_storage_plugin.kvpool.probe_interval_s: 60
"""


@pytest.fixture(scope="module")
def loop():
    """LMCache's event loop, on its own thread as in LMCache's engine."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)


class Engine:
    """One LMCache worker's storage: the real backends LMCache builds from the config."""

    def __init__(
        self,
        tmp_path,
        loop,
        addr: str,
        model: str = LLAMA,
        mla: bool = False,
        cpu_gb: float = 0.2,
        worker_id: int = 0,
        world_size: int = 1,
        options: dict | None = None,
    ):
        cfg_file = tmp_path / f"lmcache-{abs(hash((model, mla, worker_id)))}.yaml"
        text = CONFIG_YAML.format(cpu_gb=cpu_gb, addr=addr)
        for k, v in (options or {}).items():
            text += f"  remote_storage_plugin.kvpool.{k}: {v}\n"
        cfg_file.write_text(text)
        self.config = LMCacheEngineConfig.from_file(str(cfg_file))
        self.metadata = LMCacheMetadata(
            model_name=model,
            world_size=world_size,
            local_world_size=world_size,
            worker_id=worker_id,
            local_worker_id=worker_id,
            kv_dtype=torch.bfloat16,
            kv_shape=MLA_SHAPE if mla else LLAMA_SHAPE,
            use_mla=mla,
        )
        self.loop = loop
        self.backends = CreateStorageBackends(self.config, self.metadata, loop)
        self.cpu = self.backends["LocalCPUBackend"]
        self.remote = self.backends["RemoteBackend-kvpool"]
        # LMCache wraps every connector in its InstrumentedRemoteConnector.
        self.connector: KvpoolRemoteConnector = (
            self.remote.connection.getWrappedConnector()
        )

    def key(self, chunk_hash: int) -> CacheEngineKey:
        md = self.metadata
        return CacheEngineKey(
            md.model_name, md.world_size, md.worker_id, chunk_hash, md.kv_dtype
        )

    def chunk(self, seed: int, tokens: int | None = None):
        """A MemoryObj from LMCache's CPU backend holding random bytes, and a copy of them."""
        md = self.metadata
        obj = self.cpu.allocate(md.get_shapes(tokens), md.get_dtypes())
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        raw = obj.tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        return obj, raw.clone()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def put(self, keys, objs) -> None:
        """RemoteBackend's batched put, waited for (it is asynchronous in LMCache): its
        per-key callback runs once the connector returned and LMCache dropped its refs."""
        done = threading.Semaphore(0)
        self.remote.batched_submit_put_task(
            keys, objs, on_complete_callback=lambda _k: done.release()
        )
        for _ in keys:
            assert done.acquire(timeout=30), "the batched put did not finish"

    def in_use(self) -> int:
        """Bytes LMCache's CPU arena has handed out and not taken back."""
        return self.cpu.memory_allocator.pin_allocator.total_allocated_size

    def close(self) -> None:
        for b in reversed(list(self.backends.values())):
            b.close()


@pytest.fixture
def engines(tmp_path, loop):
    made: list[Engine] = []

    def make(addr: str, **kw) -> Engine:
        e = Engine(tmp_path, loop, addr, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def release(objs) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


def same_bytes(obj, raw) -> bool:
    return torch.equal(obj.tensor.view(torch.uint8), raw)


def test_endpoint_of_urls():
    assert endpoint_of("kvpool://127.0.0.1:7070") == ("tcp://127.0.0.1:7070", None)
    assert endpoint_of("kvpool://h:1?namespace=lmc") == ("tcp://h:1", "lmc")
    assert endpoint_of("kvpool://[::1]:7070") == ("tcp://[::1]:7070", None)
    assert endpoint_of("kvpool:///run/kvpoold.sock") == (
        "unix:///run/kvpoold.sock",
        None,
    )
    for bad in ("redis://h:1", "kvpool://h", "kvpool://", "kvpool://h:x"):
        with pytest.raises(ValueError):
            endpoint_of(bad)


def test_config_discovers_the_plugin(kvpoold, engines, loop):
    e = engines(kvpoold.tcp)
    # CreateStorageBackends made a RemoteBackend for the plugin, on our connector...
    assert e.remote.remote_url == "plugin://kvpool"
    assert isinstance(e.connector, KvpoolRemoteConnector)
    assert e.connector.url == f"kvpool://{kvpoold.tcp}"
    # ... with the CPU backend's arena registered once, so gets and puts are pointer calls.
    assert len(e.connector._arenas) == 1
    assert e.connector.store.is_local
    # The manager LMCache builds for the URL discovered the adapter from extra_config.
    mgr = ConnectorManager("plugin://kvpool", loop, e.cpu, e.config, e.metadata)
    ours = [a for a in mgr.adapters if isinstance(a, KvpoolConnectorAdapter)]
    assert len(ours) == 1
    assert ours[0].can_parse("plugin://kvpool.second")
    assert ours[0].can_parse(f"kvpool://{kvpoold.tcp}")
    assert not ours[0].can_parse("plugin://redis")
    # The legacy remote_url form reaches the same adapter.
    legacy = CreateConnector(
        f"kvpool://{kvpoold.tcp}", loop, e.cpu, e.config, e.metadata
    )
    assert isinstance(legacy.getWrappedConnector(), KvpoolRemoteConnector)
    e.run(legacy.close())


def test_llama_chunks_round_trip_through_lmcache(kvpoold, engines):
    e = engines(kvpoold.tcp)
    base = e.in_use()
    keys = [e.key(0x1000 + i) for i in range(4)]
    chunks = [e.chunk(i) for i in range(3)]
    objs = [o for o, _ in chunks]
    assert objs[0].get_size() == 2 * 32 * 256 * 8 * 128 * 2
    e.put(keys[:3], objs)
    release(
        objs
    )  # LMCache's hot cache would hold them; the remote copy is what is read
    assert e.in_use() == base
    assert e.connector.stats()["stores"] == 3

    # Lookups: RemoteBackend's batched_contains (one match_prefix), contains, the async form.
    assert e.remote.batched_contains(keys) == 3
    assert e.remote.contains(keys[2]) and not e.remote.contains(keys[3])
    assert e.run(e.remote.batched_async_contains("req-1", keys)) == 3
    assert e.run(e.remote.batched_async_contains("req-2", keys[3:] + keys[:3])) == 0

    # A blocking batched get: one batch_get_into into fresh MemoryObjs, bytes exact.
    got = e.remote.batched_get_blocking(keys)
    assert got[3] is None
    for (_, raw), obj in zip(chunks, got[:3]):
        assert same_bytes(obj, raw)
        assert obj.get_shapes() == e.metadata.get_shapes()
    release(got)
    # The non-blocking get returns the leading run and releases the rest itself.
    run = e.run(e.remote.batched_get_non_blocking("req-3", [keys[0], keys[3], keys[1]]))
    assert len(run) == 1 and same_bytes(run[0], chunks[0][1])
    release(run)
    assert e.in_use() == base  # nothing leaked: misses and the tail were released
    s = e.connector.stats()
    # Five chunks were read (three, then two in the one batch of the non-blocking get).
    assert s["bytes_read"] == 5 * objs[0].get_size() and s["errors"] == 0

    # The connector's own single-key calls, through LMCache's InstrumentedRemoteConnector.
    conn = e.remote.connection
    assert e.run(conn.exists(keys[1])) and conn.exists_sync(keys[1])
    one = e.run(conn.get(keys[1]))
    assert same_bytes(one, chunks[1][1])
    release([one])
    assert e.run(conn.get(keys[3])) is None
    assert e.run(conn.list()) == []
    assert e.remote.remove(keys[1]) and not conn.exists_sync(keys[1])
    assert e.remote.batched_contains(keys) == 1
    assert e.in_use() == base


def test_mla_chunk_and_partial_chunk(kvpoold, engines):
    e = engines(kvpoold.tcp, model=DEEPSEEK, mla=True)
    assert e.connector.meta_fmt.name == "KV_MLA_FMT"
    full, full_raw = e.chunk(7)
    part, part_raw = e.chunk(8, tokens=100)  # the last, partial chunk of a prompt
    assert full.get_size() == 61 * 256 * 576 * 2
    assert part.get_size() == 61 * 100 * 576 * 2
    keys = [e.key(0xA), e.key(0xB)]
    # A single put (the RemoteBackend's per-key path) and a batched one.
    fut = e.remote.submit_put_task(keys[0], full)
    fut.result(30)
    e.put(keys[1:], [part])
    release([full, part])
    got = e.remote.batched_get_blocking(keys)
    assert same_bytes(got[0], full_raw)
    # The shorter value came back reshaped to its 100 tokens by LMCache's own code.
    assert list(got[1].meta.shape) == [1, 61, 100, 576]
    assert got[1].get_size() == part.get_size()
    assert same_bytes(got[1], part_raw)
    release(got)


@pytest.mark.parametrize("same_host", [True, False])
def test_killed_kvpoold_gives_misses_never_exceptions(kvpoold, engines, same_host):
    e = engines(kvpoold.tcp, options={"same_host": str(same_host).lower()})
    assert e.connector.store.is_local == same_host
    base = e.in_use()
    keys = [e.key(0x2000), e.key(0x2001)]
    obj, _ = e.chunk(1)
    e.put(keys[:1], [obj])
    assert e.remote.batched_contains(keys) == 1
    kvpoold.kill()
    for _ in range(2):  # twice: a dead node stays a miss
        assert e.remote.batched_contains(keys) == 0
        assert not e.remote.contains(keys[0])
        assert e.run(e.remote.batched_async_contains("r", keys)) == 0
        assert e.remote.batched_get_blocking(keys) == [None, None]
        assert e.run(e.remote.batched_get_non_blocking("r", keys)) == []
        assert e.remote.get_blocking(keys[0]) is None
    e.put(keys[1:], [obj])  # a failed store is counted, not raised
    release([obj])
    assert e.in_use() == base  # every MemoryObj allocated for a failed get was released
    s = e.connector.stats()
    assert s["hits"] == 0 and s["bytes_read"] == 0 and s["store_failures"] == 1
    assert e.remote.put_failed_count == 0  # LMCache saw no failed put task
    # Only the store reports the dead node as an error: kvpool's client answers lookups and
    # loads of a dead node as misses (0, -704), so they cost nothing and count as misses.
    assert s["errors"] >= 1 and s["misses"] >= 10


def test_two_models_do_not_share_keys(kvpoold, engines):
    a = engines(kvpoold.tcp, model=LLAMA)
    b = engines(kvpoold.tcp, model="meta-llama/Llama-3.1-8B-Instruct")
    # The same tokens give the same chunk hash; the key differs by the model's name.
    ka, kb = a.key(0x3000), b.key(0x3000)
    assert a.connector.kvpool_key(ka) != b.connector.kvpool_key(kb)
    assert LLAMA in a.connector.kvpool_key(ka)
    obj, _ = a.chunk(3)
    a.put([ka], [obj])
    release([obj])
    assert a.remote.batched_contains([ka]) == 1
    assert b.remote.batched_contains([kb]) == 0
    assert b.remote.batched_get_blocking([kb]) == [None]
    # Another tensor-parallel rank of the same model has its own key, too.
    r1 = engines(kvpoold.tcp, model=LLAMA, worker_id=1, world_size=2)
    r0 = engines(kvpoold.tcp, model=LLAMA, worker_id=0, world_size=2)
    assert r1.connector.kvpool_key(r1.key(0x3000)) != r0.connector.kvpool_key(
        r0.key(0x3000)
    )
    # The MLA layout salts its keys apart from the MHA one of the same name.
    m = engines(kvpoold.tcp, model=LLAMA, mla=True)
    assert m.connector.salt != a.connector.salt


def test_long_key_is_hashed_and_still_round_trips(kvpoold, engines):
    e = engines(kvpoold.tcp, model="org/" + "m" * 300, cpu_gb=0.1)
    k = e.key(0x4000)
    assert len(e.connector.kvpool_key(k)) < 256
    assert "sha256:" in e.connector.kvpool_key(k)
    obj, raw = e.chunk(4)
    e.put([k], [obj])
    release([obj])
    got = e.remote.batched_get_blocking([k])
    assert same_bytes(got[0], raw)
    release(got)


def test_memory_outside_the_registered_arena_takes_the_copying_path(kvpoold, engines):
    e = engines(kvpoold.tcp, cpu_gb=0.1)
    e.connector._arenas.clear()  # as with an allocator whose arena it can't find
    k = e.key(0x5000)
    obj, raw = e.chunk(5)
    e.put([k], [obj])
    release([obj])
    got = e.remote.batched_get_blocking([k, e.key(0x5001)])
    assert same_bytes(got[0], raw) and got[1] is None
    release(got)


def test_a_cancelled_get_releases_its_memory_only_when_the_copy_is_done(
    kvpoold, engines
):
    e = engines(kvpoold.tcp)
    base = e.in_use()
    k = e.key(0x6000)
    obj, _ = e.chunk(6)
    e.put([k], [obj])
    release([obj])
    conn = e.connector

    async def cancel_soon():
        task = asyncio.ensure_future(conn.batched_get([k, k]))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        release(task.result())
        return "finished first"

    assert e.run(cancel_soon()) in ("cancelled", "finished first")
    deadline = time.monotonic() + 30
    while e.in_use() != base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.in_use() == base


def test_the_plugin_class_alone_is_a_connector_too(kvpoold, engines, loop):
    """``class_name: KvpoolRemoteConnector`` works as well: LMCache then wraps the connector in
    its DynamicConnectorAdapter (``cls(loop=, local_cpu_backend=, config=)``)."""
    e = engines(kvpoold.tcp, cpu_gb=0.1)
    cfg = e.config
    cfg.extra_config["remote_storage_plugin.kvpool.class_name"] = (
        "KvpoolRemoteConnector"
    )
    c = CreateConnector("plugin://kvpool", loop, e.cpu, cfg, e.metadata, "kvpool")
    assert isinstance(c.getWrappedConnector(), KvpoolRemoteConnector)
    assert c.batched_contains([e.key(1)]) == 0
    asyncio.run_coroutine_threadsafe(c.close(), loop).result(10)


def test_blocking_calls_never_run_on_lmcaches_event_loop(kvpoold, engines):
    e = engines(kvpoold.tcp, cpu_gb=0.1)
    store = e.connector.store
    threads: list[str] = []

    def spy(name):
        real = getattr(store, name)

        def call(*a, **kw):
            threads.append(threading.current_thread().name)
            return real(*a, **kw)

        return call

    for name in ("match_prefix", "load_lengths", "save"):
        setattr(store, name, spy(name))
    k = e.key(0x7000)
    obj, raw = e.chunk(7)
    e.put([k], [obj])  # batched_put, a coroutine on LMCache's loop
    release([obj])
    assert e.run(e.remote.batched_async_contains("r", [k])) == 1
    got = e.run(e.remote.batched_get_non_blocking("r", [k]))
    assert same_bytes(got[0], raw)
    release(got)
    assert e.run(e.remote.connection.exists(k))
    assert len(threads) == 4
    assert all(t.startswith("kvpool-lmcache") for t in threads), threads

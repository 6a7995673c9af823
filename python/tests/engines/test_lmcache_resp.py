"""The zero-code route: LMCache's own ``redis://`` and ``resp://`` remote connectors against
kvpoold's RESP front door (``kvpoold --resp``), for real.

LMCache (0.5.6) builds its real backends from a real ``LMCacheEngineConfig`` (``remote_url``, as
its docs write it): ``CreateStorageBackends`` → ``RemoteBackend`` → its ``ConnectorManager`` →
``RedisConnectorAdapter``/``RESPConnectorAdapter``. ``redis://`` is its ``RedisConnector`` on
redis-py's asyncio client (two keys a chunk, ``<key>kv_bytes`` then ``<key>metadata``);
``resp://`` is its ``RESPConnector`` on the native C++ client ``lmcache.lmcache_redis`` (one key
a chunk, exact-length GETs, no ``HELLO``). The chunks are Llama-3-8B-shaped ``MemoryObj``\\ s
(32 MiB) from LMCache's CPU backend; the bytes are compared exactly, and the native kvpool client
reads what LMCache wrote."""

from __future__ import annotations

import asyncio
import importlib
import threading

import pytest
from conftest import in_ci

try:
    import kvpool
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends
    from lmcache.v1.storage_backend.connector.redis_connector import (
        RedisConnector,
        RESPConnector,
    )
except ImportError as e:  # the engines venv is missing (scripts/python-env builds it)
    if in_ci():
        raise
    pytest.skip(f"LMCache is not installed: {e}", allow_module_level=True)

MODEL = "meta-llama/Meta-Llama-3-8B"
KV_SHAPE = (32, 2, 256, 8, 128)
CHUNK_BYTES = 2 * 32 * 256 * 8 * 128 * 2


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)


@pytest.fixture
def resp_door(start_kvpoold):
    """A kvpoold with its RESP door on a free port: ``(daemon, "host:port")``."""
    d = start_kvpoold(memory="512MiB", extra=["--resp", "127.0.0.1:0"])
    return d, d.addr("resp")


class Lmcache:
    """LMCache's storage backends, built by LMCache from a YAML config file."""

    def __init__(self, tmp_path, loop, yaml_text: str):
        f = tmp_path / "lmcache.yaml"
        f.write_text(yaml_text)
        self.config = LMCacheEngineConfig.from_file(str(f))
        self.metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=KV_SHAPE,
        )
        self.loop = loop
        self.backends = CreateStorageBackends(self.config, self.metadata, loop)
        self.cpu = self.backends["LocalCPUBackend"]
        self.remote = self.backends["RemoteBackend"]
        self.connector = self.remote.connection.getWrappedConnector()

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey(MODEL, 1, 0, chunk_hash, torch.bfloat16)

    def chunk(self, seed: int):
        md = self.metadata
        obj = self.cpu.allocate(md.get_shapes(), md.get_dtypes())
        assert obj is not None
        raw = obj.tensor.view(torch.uint8)
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        return obj, raw.clone()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def put(self, keys, objs) -> None:
        """RemoteBackend's batched put, waited for through its per-key callback."""
        done = threading.Semaphore(0)
        self.remote.batched_submit_put_task(
            keys, objs, on_complete_callback=lambda _k: done.release()
        )
        for _ in keys:
            assert done.acquire(timeout=60), "the batched put did not finish"
        for o in objs:
            o.ref_count_down()

    def close(self) -> None:
        """Closes the backends. Not through ``RemoteBackend.close()``: in LMCache 0.5.6
        ``RedisConnector.close()`` and ``RESPConnector.close()`` call the blocking
        ``AsyncPQExecutor.shutdown(wait=True)`` on the event loop's own thread, which waits
        for a coroutine of that same loop and never returns. So this does what they mean to."""
        conn = self.connector

        async def close_connector() -> None:
            await conn.pq_executor.shutdown_async(wait=False)
            if isinstance(conn, RedisConnector):
                await conn.connection.aclose()
            else:
                conn.client.close()

        self.run(close_connector(), timeout=10)
        self.cpu.close()


@pytest.fixture
def lmcache(tmp_path, loop):
    made: list[Lmcache] = []

    def make(yaml_text: str) -> Lmcache:
        m = Lmcache(tmp_path, loop, yaml_text)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def same_bytes(obj, raw) -> bool:
    return obj is not None and torch.equal(obj.tensor.view(torch.uint8), raw)


def test_lmcache_redis_connector_on_the_resp_door(resp_door, lmcache):
    daemon, addr = resp_door
    lm = lmcache(
        f"""\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 0.2
remote_url: "redis://{addr}"
remote_serde: naive
"""
    )
    assert isinstance(lm.connector, RedisConnector)
    keys = [lm.key(0x100 + i) for i in range(3)]
    chunks = [lm.chunk(i) for i in range(2)]
    lm.put(keys[:2], [o for o, _ in chunks])

    # exists: EXISTS <key>metadata; batched contains: one EXISTS per key up to the first miss.
    assert lm.remote.contains(keys[0]) and not lm.remote.contains(keys[2])
    assert lm.remote.batched_contains(keys) == 2
    assert lm.run(lm.remote.batched_async_contains("req", keys)) == 2
    # get: GET <key>metadata, then GET <key>kv_bytes, into a fresh MemoryObj.
    got = lm.remote.batched_get_blocking(keys[:2])
    for (_, raw), obj in zip(chunks, got):
        assert same_bytes(obj, raw)
        obj.ref_count_down()
    assert lm.remote.get_blocking(keys[2]) is None
    run = lm.run(lm.remote.batched_get_non_blocking("req", keys))
    assert [same_bytes(o, raw) for o, (_, raw) in zip(run, chunks)] == [True, True]
    for o in run:
        o.ref_count_down()

    # What LMCache wrote is an ordinary kvpool object: the native client reads the chunk.
    with kvpool.Client(daemon.url) as c:
        value = c.get(keys[0].to_string() + "kv_bytes")
        assert value == bytes(chunks[0][1].numpy())
        assert len(c.get(keys[0].to_string() + "metadata")) == 28  # RemoteMetadata


def test_lmcache_native_resp_connector_on_the_resp_door(resp_door, lmcache):
    # LMCache's C++ RESP client imports on this CPU-only machine (it links libtorch only).
    assert importlib.import_module("lmcache.lmcache_redis").LMCacheRedisClient
    daemon, addr = resp_door
    lm = lmcache(
        f"""\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 0.2
remote_url: "resp://{addr}"
remote_serde: naive
save_unfull_chunk: false
extra_config:
  save_chunk_meta: false
  resp_num_threads: 2
"""
    )
    assert isinstance(lm.connector, RESPConnector)
    keys = [lm.key(0x200 + i) for i in range(3)]
    chunks = [lm.chunk(10 + i) for i in range(2)]
    lm.put(keys[:2], [o for o, _ in chunks])  # SET key <exactly the chunk's bytes>

    assert lm.remote.contains(keys[1]) and not lm.remote.contains(keys[2])  # EXISTS
    # Only the asynchronous calls: LMCache 0.5.6's synchronous ones (exists_sync, and
    # batched_contains through batch_exists_sync) can lose their completion to the event loop's
    # thread and wait forever (docs/ENGINES.md).
    assert lm.run(lm.connector.exists(keys[0]))
    assert lm.run(lm.remote.batched_async_contains("req", keys)) == 2
    got = lm.remote.batched_get_blocking(keys[:2])  # GET into an exact-size buffer
    for (_, raw), obj in zip(chunks, got):
        assert same_bytes(obj, raw)
        obj.ref_count_down()
    one = lm.remote.get_blocking(keys[1])
    assert same_bytes(one, chunks[1][1])
    one.ref_count_down()

    with kvpool.Client(daemon.url) as c:
        assert c.get(keys[1].to_string()) == bytes(chunks[1][1].numpy())
        assert len(c.get(keys[1].to_string())) == CHUNK_BYTES

"""kvpool.lmcache_mp against a real kvpoold, driven by LMCache's own (0.5.6) MP storage.

Each "server" is what ``lmcache server`` builds from its command line: the flags go through
LMCache's own parser (``lmcache.v1.distributed.config.parse_args``, the ``--l2-adapter`` JSON a
user writes), and LMCache's real ``StorageManager`` creates the L1 (its CPU arena), the plugin
L2 adapter (LMCache's ``plugin`` factory imports ``kvpool.lmcache_mp``), and the store, prefetch
and eviction controllers that drive it. Chunks are Llama-3-8B shaped (KV_2LTD: 2 × 32 layers ×
256 tokens × 8 heads × 128, bf16: 32 MiB a chunk), written into L1 buffers the manager reserves,
stored to kvpool by LMCache's StoreController, and loaded back by its PrefetchController into a
second manager's L1. Bytes are compared exactly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import subprocess
import sys
import time
import uuid

import pytest
from conftest import in_ci

try:
    import torch
    from kvpool.lmcache_mp import KvpoolL2Adapter, KvpoolL2AdapterConfig, layout_tag
    from lmcache.v1.check.check_mode_test_l2_adapter import (
        run_test_mode as lmcache_adapter_check,
    )
    from lmcache.v1.distributed.api import (
        GroupedObjectKeys,
        MemoryLayoutDesc,
        ObjectKey,
        PrefetchTaskSpec,
    )
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager
    from lmcache.v1.platform.event_notifier import consume_fd
except ImportError as e:  # the engines venv is missing (scripts/python-env builds it)
    if in_ci():
        raise
    pytest.skip(f"LMCache is not installed: {e}", allow_module_level=True)

LLAMA = "meta-llama/Meta-Llama-3-8B"
LLAMA_LAYOUT = (torch.Size([2, 32, 256, 8 * 128]), torch.bfloat16)  # 32 MiB a chunk
CHUNKS = 4


def layout(shape=LLAMA_LAYOUT[0], dtype=LLAMA_LAYOUT[1]) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[shape], dtypes=[dtype])


def object_keys(model: str = LLAMA, n: int = CHUNKS, first: int = 0) -> list[ObjectKey]:
    return [
        ObjectKey(
            chunk_hash=(first + i).to_bytes(4, "big") * 8, model_name=model, kv_rank=0
        )
        for i in range(n)
    ]


def plugin_flag(addr: str, **params) -> str:
    """The ``--l2-adapter`` JSON of docs/ENGINES.md."""
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvpool.lmcache_mp",
            "class_name": "KvpoolL2Adapter",
            "adapter_params": {"url": f"kvpool://{addr}", **params},
        }
    )


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def server_config(flags: list[str]):
    """The storage config ``lmcache server`` builds from ``flags``, with its own L1 shared
    memory name (the server's ``--shm-name``; several servers share this test's process)."""
    config = parse_args(flags)
    config.l1_manager_config.memory_config.shm_name = (
        f"kvpool_test_l1_{uuid.uuid4().hex}"
    )
    return config


class Server:
    """One LMCache MP server's storage: LMCache's StorageManager from its own command line."""

    def __init__(self, addr: str | None, l1_gb: float = 0.3, **params):
        flags = ["--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU"]
        if addr is not None:
            # Deadlines for a debug kvpoold on a busy CI machine, not for production.
            params = {"lookup_timeout_ms": 2000, "io_timeout_ms": 30000, **params}
            flags += ["--l2-adapter", plugin_flag(addr, **params)]
        self.sm: StorageManager | None = StorageManager(server_config(flags))
        adapters = self.sm.l2_adapters()
        self.adapter: KvpoolL2Adapter | None = adapters[0][1] if adapters else None

    def write(self, keys, desc=None, seed: int = 0) -> list[torch.Tensor]:
        """Writes random chunks into L1 as the server does after a store request, which makes
        LMCache's StoreController hand them to the L2 adapter; returns copies of the bytes."""
        objs = self.sm.reserve_write(keys, desc or layout())
        assert len(objs) == len(keys)
        g = torch.Generator().manual_seed(seed)
        raws = []
        for k in keys:
            raw = objs[k].tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
            raws.append(raw.clone())
        self.sm.finish_write(keys)
        return raws

    def store(self, keys, desc=None, seed: int = 0) -> list[torch.Tensor]:
        """:meth:`write`, then waits until the adapter accounts every chunk as stored."""
        before = self.adapter.get_usage().total_bytes_used
        raws = self.write(keys, desc, seed)
        size = raws[0].numel()
        wait_for(
            lambda: (
                self.adapter.get_usage().total_bytes_used >= before + size * len(keys)
            )
        )
        return raws

    def prefetch(self, keys, desc=None):
        """LMCache's prefetch (L1, then L2 lookup and load into L1) of one row of keys: the
        result, and the L1 bytes of every hit (None where it missed)."""
        spec = PrefetchTaskSpec(
            key_groups=[
                GroupedObjectKeys(
                    keys=keys, object_group_id=0, layout_desc=desc or layout()
                )
            ]
        )
        handle = self.sm.submit_prefetch_task(spec)
        assert self.sm.wait_prefetch_status(handle, 30)
        result = self.sm.query_prefetch_status(handle)
        assert result is not None
        hits = result.hit_cells[0].popcount()
        got: list[torch.Tensor | None] = [None] * len(keys)
        if hits:
            held = keys[:hits]
            with self.sm.read_prefetched_results(held, result.l1_owners) as objs:
                assert objs is not None
                for i, o in enumerate(objs):
                    got[i] = o.tensor.view(torch.uint8).clone()
            self.sm.finish_read_prefetched(held, l1_owners=result.l1_owners)
        return result, got

    def close(self) -> None:
        """Stops the server; its L1 (and every chunk only it held) is gone. Idempotent."""
        sm, self.sm = self.sm, None
        if sm is not None:
            sm.close()


@pytest.fixture
def servers():
    made: list[Server] = []

    def make(addr: str | None, **kw) -> Server:
        s = Server(addr, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def same(got, raws) -> bool:
    return all(g is not None and torch.equal(g, r) for g, r in zip(got, raws))


def test_lmcache_loads_the_plugin_from_the_server_flags(kvpoold, servers):
    s = servers(kvpoold.tcp, lookup_timeout_ms=500, tag="team-a", namespace="kv")
    a = s.adapter
    assert isinstance(a, KvpoolL2Adapter)
    # LMCache found the config class by name and built it from adapter_params.
    assert isinstance(a.config, KvpoolL2AdapterConfig)
    assert a.config.endpoint == f"tcp://{kvpoold.tcp}"
    assert (a.config.namespace, a.config.tag, a.config.lookup_timeout) == (
        "kv",
        "team-a",
        0.5,
    )
    # The L1 arena LMCache described to the plugin is registered with kvpool.
    status = a.report_status()
    assert status["is_healthy"] and status["l1_registered"]
    # The three event fds are distinct (LMCache's controllers route by fd).
    fds = {
        a.get_store_event_fd(),
        a.get_lookup_and_lock_event_fd(),
        a.get_load_event_fd(),
    }
    assert len(fds) == 3
    # A wrong option fails the server's start (LMCache builds the plugin's config then).
    flags = ["--l1-size-gb", "0.1", "--eviction-policy", "LRU"]
    flags += ["--l2-adapter", plugin_flag(kvpoold.tcp, bogus=1)]
    with pytest.raises(ValueError, match="bogus"):
        StorageManager(server_config(flags))


@pytest.mark.parametrize("same_host", [True, False])
def test_llama_chunks_stored_by_one_server_load_in_another(kvpoold, servers, same_host):
    keys = object_keys()
    writer = servers(kvpoold.tcp, same_host=same_host)
    assert writer.adapter.store.is_local == same_host
    raws = writer.store(keys, seed=1)
    stats = writer.adapter.report_status()
    assert stats["stores"] == CHUNKS and stats["bytes_written"] == CHUNKS * (32 << 20)
    writer.close()  # its L1 is gone: what the reader gets can only come from kvpool

    reader = servers(kvpoold.tcp, same_host=same_host)
    result, got = reader.prefetch(keys)
    assert result.l2_hit_count == CHUNKS and result.l1_hit_count == 0
    assert same(got, raws)
    stats = reader.adapter.report_status()
    assert stats["hits"] == CHUNKS and stats["bytes_read"] == CHUNKS * (32 << 20)
    # The prefix rule is LMCache's: a missing chunk in the middle ends the hit there.
    gap = [keys[0], object_keys(first=100, n=1)[0], *keys[2:]]
    result, got = reader.prefetch(gap)
    assert result.hit_cells[0].popcount() == 1
    assert same(got[:1], raws[:1])


def test_a_stored_chunk_is_stored_once(kvpoold, servers):
    keys = object_keys(n=2)
    first = servers(kvpoold.tcp)
    raws = first.store(keys, seed=2)
    first.close()
    second = servers(kvpoold.tcp)
    second.store(keys, seed=3)  # same keys, other bytes: kvpool keeps the first value
    assert second.adapter.report_status()["bytes_written"] == 0
    second.close()
    reader = servers(kvpoold.tcp)
    _, got = reader.prefetch(keys)
    assert same(got, raws)


@pytest.mark.parametrize("same_host", [True, False])
def test_killed_kvpoold_gives_misses_never_exceptions(kvpoold, servers, same_host):
    keys = object_keys(n=2)
    s = servers(kvpoold.tcp, same_host=same_host, probe_interval_s=60)
    s.store(keys[:1], seed=4)
    kvpoold.kill()
    # LMCache's StoreController gets a failed task, not an exception.
    s.write(keys[1:], seed=5)
    wait_for(lambda: s.adapter.report_status()["store_failures"] >= 1)
    # A new server (empty L1) finds nothing and loads nothing.
    other = servers(kvpoold.tcp, same_host=same_host, probe_interval_s=60)
    for _ in range(2):  # twice: a dead node stays a miss
        result, got = other.prefetch(keys)
        assert result.hit_cells[0].popcount() == 0 and got == [None, None]
    stats = other.adapter.report_status()
    assert stats["hits"] == 0 and stats["bytes_read"] == 0


def test_another_model_layout_or_tag_never_matches(kvpoold, servers):
    keys = object_keys(n=2)
    writer = servers(kvpoold.tcp)
    writer.store(keys, seed=6)
    writer.close()
    reader = servers(kvpoold.tcp)
    other_model = object_keys(model="meta-llama/Llama-3.1-8B", n=2)
    assert reader.prefetch(other_model)[0].hit_cells[0].popcount() == 0
    fp16 = layout(dtype=torch.float16)  # same bytes per chunk, another dtype
    assert reader.prefetch(keys, fp16)[0].hit_cells[0].popcount() == 0
    short = layout(shape=torch.Size([2, 32, 128, 8 * 128]))  # another chunk size
    assert reader.prefetch(keys, short)[0].hit_cells[0].popcount() == 0
    reader.close()
    tagged = servers(kvpoold.tcp, tag="tenant-b")
    assert tagged.prefetch(keys)[0].hit_cells[0].popcount() == 0
    assert tagged.adapter.report_status()["hits"] == 0
    reader = servers(kvpoold.tcp)
    assert reader.prefetch(keys)[0].hit_cells[0].popcount() == 2


def test_lmcaches_own_adapter_check_passes(kvpoold, capsys):
    """LMCache's check mode for L2 adapters (``test_l2_adapter``): it builds the adapter from
    the ``--l2-adapter`` JSON with an L1 descriptor of its own buffer, looks up absent keys,
    stores, looks up (without layouts), loads into other buffers and compares the tensors."""
    flag = plugin_flag(kvpoold.tcp, lookup_timeout_ms=2000, io_timeout_ms=30000)
    asyncio.run(lmcache_adapter_check(model=LLAMA, l2_adapter=[flag], num_keys=5))
    out = capsys.readouterr().out
    assert "Testing L2 adapter #0 (KvpoolL2Adapter)" in out
    assert "Test Failed" not in out and "FAIL" not in out
    assert "Validation: 5/5 correctly absent" in out
    assert "Batch store OK" in out
    assert "Validation: 5/5 found" in out
    assert "Validation (content): 5/5" in out


def test_lmcaches_l2_bench_verifies_the_round_trip(kvpoold):
    """``lmcache bench l2``, LMCache's own L2 adapter benchmark, run as a user runs it, with
    its round-trip verification on: stores, lookups at the hit rate it asks for, loads, and
    the loaded bytes compared with the stored ones."""
    flag = plugin_flag(kvpoold.tcp, lookup_timeout_ms=2000, io_timeout_ms=30000)
    cmd = [
        sys.executable,
        "-m",
        "lmcache.cli.main",
        "bench",
        "l2",
        "--l2-adapter",
        flag,
    ]
    cmd += ["--num-keys", "8", "--data-size-kb", "1024", "--rounds", "2"]
    cmd += ["--lookup-max-hit-rate", "0.5", "--no-skip-verify"]
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1")
    r = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Adapter created successfully (KvpoolL2Adapter)" in r.stdout
    assert "All 8 keys data verified OK" in r.stdout
    assert re.search(r"Actual hit rate:\s+0\.50", r.stdout)


def test_keys_name_every_field_and_long_ones_are_hashed(kvpoold):
    a = KvpoolL2Adapter({"url": f"kvpool://{kvpoold.tcp}"})
    try:
        tag = layout_tag(layout().shapes, layout().dtypes)
        assert tag == "2x32x256x1024:bfloat16"
        key = ObjectKey(b"\x01" * 4, LLAMA, 0x01020304, 3, "user7")
        name = a.kvpool_key(key, tag)
        assert name.startswith("lmcache-mp:") and name.endswith(
            f":{LLAMA}@01020304@3@01010101@user7"
        )
        assert a.kvpool_key(key, "2x32x128x1024:bfloat16") != name
        long = ObjectKey(b"\x02" * 32, "m" * 300, 0)
        hashed = a.kvpool_key(long, tag)
        assert ":sha256:" in hashed and len(hashed) <= 256
    finally:
        a.close()


def test_event_fds_copying_path_and_delete(kvpoold, servers):
    """The adapter alone, driven as LMCache's controllers drive it (submit, wait for the event
    fd, pop the result), without an L1 descriptor: every byte takes the copying calls."""
    l1 = servers(None)  # only the L1: MemoryObjs from LMCache's own arena
    a = KvpoolL2Adapter({"url": f"kvpool://{kvpoold.tcp}"})
    try:
        assert not a.report_status()["l1_registered"]
        desc = layout(shape=torch.Size([2, 4, 256, 256]))  # 1 MiB chunks
        keys = object_keys(n=3)
        objs = l1.sm.reserve_write(keys, desc)
        for i, k in enumerate(keys):
            objs[k].tensor.view(torch.uint8).fill_(i + 1)

        def answer(fd: int, query):
            """As LMCache's controllers wait: poll the fd, drain it, ask for the result."""
            p = select.poll()
            p.register(fd, select.POLLIN)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if p.poll(1000):
                    consume_fd(fd)
                    result = query()
                    if result is not None and result != {}:
                        return result
            raise AssertionError("the event fd was never signalled")

        task = a.submit_store_task(keys[:2], [objs[k] for k in keys[:2]])
        done = answer(a.get_store_event_fd(), a.pop_completed_store_tasks)
        assert done[task].is_successful() and done[task].bytes_transferred() == 2 << 20
        assert a.get_usage().total_bytes_used == 2 << 20

        task = a.submit_lookup_and_lock_task(keys, {0: desc})
        found = answer(
            a.get_lookup_and_lock_event_fd(),
            lambda: a.query_lookup_and_lock_result(task),
        )
        assert found.get_indices_list() == [0, 1]
        assert a.query_lookup_and_lock_result(task) is None  # answered once
        a.submit_unlock(keys)

        for k in keys:
            objs[k].tensor.view(torch.uint8).zero_()
        task = a.submit_load_task(keys, [objs[k] for k in keys])
        loaded = answer(a.get_load_event_fd(), lambda: a.query_load_result(task))
        assert loaded.get_indices_list() == [0, 1]
        for i, k in enumerate(keys[:2]):
            assert bool((objs[k].tensor.view(torch.uint8) == i + 1).all())
        assert not bool(objs[keys[2]].tensor.view(torch.uint8).any())

        a.delete(keys[:1])
        assert a.get_usage().total_bytes_used == 1 << 20
        task = a.submit_lookup_and_lock_task(keys, {0: desc})
        found = answer(
            a.get_lookup_and_lock_event_fd(),
            lambda: a.query_lookup_and_lock_result(task),
        )
        assert found.get_indices_list() == [1]
        l1.sm.finish_write(keys)
    finally:
        a.close()

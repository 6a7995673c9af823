"""kvpool.engine.EngineStore against a real kvpoold: what an engine connector stands on.

A store that is down must cost no more than a miss: no exception reaches the caller, the breaker
opens after the threshold with one warning and answers at once, a probe closes it when kvpoold
is back, and buffers registered while it was down are registered on reconnect."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
from kvpool.engine import EngineStore, layout_salt


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def clocked_store(url: str, threshold: int = 2, interval: float = 10.0):
    """A store with short deadlines on a clock the test moves; (store, clock)."""
    clock = FakeClock()
    st = EngineStore(
        url,
        lookup_timeout=0.5,
        io_timeout=0.5,
        failure_threshold=threshold,
        probe_interval=interval,
        clock=clock,
    )
    return st, clock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_round_trip_and_counters(kvpoold):
    st = EngineStore(kvpoold.url, lookup_timeout=2.0, io_timeout=5.0)
    src = np.arange(4 * 1024, dtype=np.uint8).reshape(4, 1024)
    dst = np.zeros_like(src)
    assert st.register(src.ctypes.data, src.nbytes)
    assert st.register(dst.ctypes.data, dst.nbytes)
    keys = [f"k{i}" for i in range(4)]
    ptrs = [src.ctypes.data + i * 1024 for i in range(4)]
    assert st.save(keys[:3], ptrs[:3], [1024] * 3) == [True] * 3
    assert st.match_prefix(keys) == 3
    assert st.presence(keys) == [True, True, True, False]
    got = st.load(keys, [dst.ctypes.data + i * 1024 for i in range(4)], [1024] * 4)
    assert got == [True, True, True, False]
    assert (dst[:3] == src[:3]).all() and (dst[3] == 0).all()
    # A value of another size than the slot is not a hit.
    assert st.load(keys[:1], [dst.ctypes.data], [512]) == [False]
    s = st.stats()
    assert (s["hits"], s["misses"], s["stores"]) == (3, 2, 3)
    assert (s["bytes_read"], s["bytes_written"]) == (3 * 1024, 3 * 1024)
    assert sum(s["load_latency"]["counts"]) == 2
    assert s["errors"] == 0 and s["available"]
    assert st.put("plain", b"xyz") and st.get("plain") == b"xyz"
    assert st.get("absent") is None
    assert st.clear() == 4
    st.close()
    assert st.get("plain") is None  # closed: a miss, not an exception


def test_dead_daemon_opens_the_breaker_once_and_a_probe_closes_it(kvpoold, caplog):
    st, clock = clocked_store(kvpoold.url)
    buf = np.ones(256, dtype=np.uint8)
    assert st.register(buf.ctypes.data, buf.nbytes)
    assert st.save(["a"], [buf.ctypes.data], [256]) == [True]
    kvpoold.kill()
    caplog.set_level(logging.WARNING, logger="kvpool.engine")
    for _ in range(2):
        assert st.save(["b"], [buf.ctypes.data], [256]) == [False]
    assert not st.available
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "probing" in warnings[0].getMessage()
    # Open: calls answer misses without asking the daemon.
    before = st.stats()["skipped"]
    assert st.load(["a"], [buf.ctypes.data], [256]) == [False]
    assert st.match_prefix(["a"]) == 0
    assert st.get("a") is None and not st.put("a", b"1")
    assert st.stats()["skipped"] == before + 4
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    kvpoold.start()  # same ports and data directory
    clock.t += 10.0  # a probe is due
    # The probe may need a moment while the client reconnects; each failed probe waits for
    # the next interval.
    for _ in range(50):
        if st.save(["c"], [buf.ctypes.data], [256]) == [True]:
            break
        clock.t += 10.0
    assert st.available
    dst = np.zeros(256, dtype=np.uint8)
    assert st.register(dst.ctypes.data, dst.nbytes)
    assert st.load(["c"], [dst.ctypes.data], [256]) == [True] and dst.all()
    assert st.stats()["breaker_opened"] == 1


@pytest.mark.parametrize("op", ["match_prefix", "presence", "load"])
def test_lookups_and_loads_alone_open_the_breaker(kvpoold, op):
    # The client answers an unreachable node's keys as misses rather than raising; the store
    # still tells that from a miss, so an engine that only reads stops asking a dead daemon.
    st, _ = clocked_store(kvpoold.url)
    buf = np.zeros(64, dtype=np.uint8)
    assert st.register(buf.ctypes.data, buf.nbytes)
    calls = {
        "match_prefix": lambda: st.match_prefix(["a", "b"]),
        "presence": lambda: st.presence(["a"]),
        "load": lambda: st.load(["a"], [buf.ctypes.data], [64]),
    }
    calls[op]()  # a genuine miss on a live daemon is not a failure
    assert st.available and st.stats()["errors"] == 0
    kvpoold.kill()
    for _ in range(2):
        calls[op]()
    assert not st.available
    assert st.stats()["breaker_opened"] == 1


def test_store_created_while_daemon_is_down_connects_later(start_kvpoold):
    port = free_port()
    st, clock = clocked_store(f"tcp://127.0.0.1:{port}", threshold=1, interval=1.0)
    buf = np.full(64, 7, dtype=np.uint8)
    assert st.register(buf.ctypes.data, buf.nbytes)  # remembered for the connect
    assert not st.available
    assert st.save(["x"], [buf.ctypes.data], [64]) == [False]
    start_kvpoold(tcp=f"127.0.0.1:{port}")
    for _ in range(50):
        clock.t += 1.0
        if st.save(["x"], [buf.ctypes.data], [64]) == [True]:
            break
    assert st.available
    assert st.match_prefix(["x", "y"]) == 1


def test_layout_salt_separates_layouts():
    a = layout_salt(model="m", dtype="bf16", page=16, tp=1)
    assert a == layout_salt(tp=1, page=16, dtype="bf16", model="m")
    assert len(a) == 16
    others = {
        layout_salt(model="m2", dtype="bf16", page=16, tp=1),
        layout_salt(model="m", dtype="fp16", page=16, tp=1),
        layout_salt(model="m", dtype="bf16", page=64, tp=1),
        layout_salt(model="m", dtype="bf16", page=16, tp=2),
    }
    assert a not in others and len(others) == 4


def test_get_many_into_fills_unregistered_buffers(kvpoold):
    st = EngineStore(kvpoold.url, lookup_timeout=2.0, io_timeout=5.0)
    assert st.put("a", b"x" * 64) and st.put("b", b"y" * 32)
    bufs = [bytearray(64), bytearray(64), bytearray(64)]
    assert st.get_many_into(["a", "b", "absent"], bufs) == [64, 32, None]
    assert bytes(bufs[0]) == b"x" * 64 and bytes(bufs[1][:32]) == b"y" * 32
    s = st.stats()
    assert (s["hits"], s["misses"], s["bytes_read"]) == (2, 1, 96)
    st.close()
    assert st.get_many_into(["a"], [bytearray(64)]) == [None]  # closed: a miss


def test_load_lengths_accepts_a_shorter_value_only(kvpoold):
    st = EngineStore(kvpoold.url, lookup_timeout=2.0, io_timeout=5.0)
    src = np.arange(3000, dtype=np.uint16).view(np.uint8)[:3000]
    dst = np.zeros(3 * 4096, dtype=np.uint8)
    assert st.register(src.ctypes.data, src.nbytes)
    assert st.register(dst.ctypes.data, dst.nbytes)
    assert st.save(["short", "long"], [src.ctypes.data] * 2, [1000, 3000]) == [True] * 2
    ptrs = [dst.ctypes.data + i * 4096 for i in range(3)]
    # A shorter value fills the start of its slot; a longer one and a miss are 0.
    assert st.load_lengths(["short", "long", "absent"], ptrs, [4096, 2048, 4096]) == [
        1000,
        0,
        0,
    ]
    assert (dst[:1000] == src[:1000]).all() and not dst[4096:].any()
    assert st.load(["short"], ptrs[:1], [4096]) == [False]  # load wants the exact size
    s = st.stats()
    assert (s["hits"], s["misses"], s["bytes_read"]) == (1, 3, 1000)
    st.close()

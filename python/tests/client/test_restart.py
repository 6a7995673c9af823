"""A dead or unreachable daemon: calls fail within the timeout, never hang, and the client
reconnects on its own when the daemon comes back on the same ports."""

from __future__ import annotations

import socket
import time

import kvpool
import pytest

TIMEOUT_S = 2.0
# The bound a failing call must respect: its timeout, plus a connect attempt and slack for a
# loaded machine. A hang would exceed it by far.
BOUND_S = 3 * TIMEOUT_S + 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_fails_fast():
    t = time.monotonic()
    with pytest.raises(kvpool.ConnectionError) as e:
        kvpool.Client(f"tcp://127.0.0.1:{free_port()}", timeout=TIMEOUT_S)
    assert time.monotonic() - t < BOUND_S
    assert e.value.code == -900


def test_daemon_killed_under_a_running_client(kvpoold):
    kv = kvpool.Client(kvpoold.url, timeout=TIMEOUT_S)
    kv.write("before", b"1")
    assert kv.read("before") == b"1"

    kvpoold.kill()
    # A write fails; a read finds nothing (the client counts an unreachable node's keys as
    # misses, or reports the node unreachable); neither waits past the bound.
    t = time.monotonic()
    with pytest.raises(kvpool.ConnectionError):
        kv.write("during", b"2")
    assert time.monotonic() - t < BOUND_S
    t = time.monotonic()
    with pytest.raises((kvpool.ConnectionError, kvpool.NotFoundError)):
        kv.read_into("before", bytearray(8))
    assert time.monotonic() - t < BOUND_S
    t = time.monotonic()
    assert kv.match_prefix([b"before"]) == 0
    assert kv.is_exist("before") in (0, -900)
    assert time.monotonic() - t < 2 * BOUND_S
    t = time.monotonic()
    assert kv.put("during", b"2") == -900
    assert kv.health_check() == 2
    assert time.monotonic() - t < 2 * BOUND_S

    kvpoold.start()  # the same data directory and ports
    deadline = time.monotonic() + 30
    while True:
        try:
            kv.write("after", b"3")
            break
        except kvpool.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert kv.read("after") == b"3"
    assert kv.health_check() == 0
    buf = bytearray(8)
    assert kv.read_into("after", buf) == 1 and buf[:1] == b"3"
    kv.close()

"""Handoffs from Python (docs/HANDOFF.md): a consumer thread waits for keys a producer thread
writes, against a real kvpoold; a producer's ``fail`` wakes the waiter at once with its reason;
a silent producer leaves the wait to time out with exactly the missing keys; ``cancel`` frees a
request on both sides in one call."""

from __future__ import annotations

import ctypes
import threading
import time

import kvpool
import pytest


@pytest.fixture
def pair(kvpoold):
    with kvpool.Client(kvpoold.url) as producer, kvpool.Client(kvpoold.url) as consumer:
        yield producer, consumer


def test_a_wait_ends_when_the_producer_writes(pair):
    producer, consumer = pair
    keys = [f"req-1/block-{i}".encode() for i in range(8)]
    started = threading.Event()
    out = {}

    def consume():
        started.set()
        out["got"] = consumer.wait(keys, timeout=60.0)

    t = threading.Thread(target=consume)
    t.start()
    started.wait()
    for i, k in enumerate(keys):
        producer.put(k, bytes([i]) * 4096)
    t.join(timeout=90)
    assert not t.is_alive()
    assert out["got"] == ([], [])
    assert consumer.get(keys[5]) == bytes([5]) * 4096


def test_fail_wakes_the_waiter_with_the_reason(pair):
    producer, consumer = pair
    keys = ["req-2/a", "req-2/b"]
    producer.put("req-2/a", b"kv")
    out = {}
    t = threading.Thread(target=lambda: out.update(got=consumer.wait(keys, 60.0)))
    t.start()
    assert producer.fail(["req-2/b"], "decode instance went away") == 1
    t.join(timeout=90)
    missing, failed = out["got"]
    assert missing == []
    assert failed == [(b"req-2/b", "decode instance went away")]


def test_a_silent_producer_times_out_with_the_missing_keys(pair):
    producer, consumer = pair
    producer.put("req-3/a", b"kv")
    missing, failed = consumer.wait(["req-3/a", "req-3/b", "req-3/c"], timeout=0.2)
    assert missing == [b"req-3/b", b"req-3/c"] and failed == []
    with pytest.raises(kvpool.InvalidArgumentError):
        consumer.wait(["x"], timeout=-1)
    with pytest.raises(kvpool.InvalidArgumentError):
        consumer.wait(["x"], timeout=float("nan"))


def test_a_subscription_hears_the_prefix(pair):
    producer, consumer = pair
    sub = consumer.subscribe("req-4/")
    producer.put("req-4/a", b"1")
    producer.put("other", b"1")
    producer.fail(["req-4/b"], "aborted")
    got = [sub.next(20.0), sub.next(20.0)]
    assert got == [("written", b"req-4/a"), ("failed", b"req-4/b", "aborted")]
    assert sub.next(0.05) is None
    sub.close()
    assert sub.next(0.05) is None


def test_a_lapsed_lease_frees_the_blocks(pair):
    producer, consumer = pair
    producer.put("req-5/a", b"kv")
    producer.put("req-5/b", b"kv")
    assert producer.expire(["req-5/a", "req-5/b", "req-5/none"], 0.2) == 2
    assert consumer.expire(["req-5/b"], 600.0) == 1  # the consumer renews one
    deadline = time.monotonic() + 20
    while consumer.exists("req-5/a"):
        assert time.monotonic() < deadline, "the lease never lapsed"
        time.sleep(0.05)
    assert consumer.exists("req-5/b")
    with pytest.raises(kvpool.InvalidArgumentError):
        consumer.expire(["req-5/b"], float("inf"))


def test_one_sided_handoff_consumer_reserves_producer_writes_and_commits(pair):
    producer, consumer = pair
    block = bytes(range(256)) * 256  # 64 KiB
    address = consumer.reserve("req-6/kv", len(block))
    assert isinstance(address, bytes)
    out = {}
    t = threading.Thread(
        target=lambda: out.update(got=consumer.wait(["req-6/kv"], 60.0))
    )
    t.start()
    # The producer (another client: another process in practice) writes in two pieces.
    producer.write_reserved(address, block[:1000])
    producer.write_reserved(address, memoryview(block)[1000:], offset=1000)
    with pytest.raises(kvpool.Error):
        producer.commit_reserved(address, kvpool.checksum(block) ^ 1)  # wrong: refused
    address = consumer.reserve("req-6/kv", len(block))  # the refused one was released
    producer.write_reserved(address, block)
    producer.commit_reserved(address, kvpool.checksum(block))
    t.join(timeout=90)
    assert out["got"] == ([], [])
    assert consumer.read("req-6/kv") == block
    with pytest.raises(kvpool.InvalidArgumentError):
        producer.write_reserved(b"not an address", b"x")
    # (A forged memory key is refused by the node: tests/handoff.rs.)


def test_cancel_frees_a_request_on_both_sides_and_wakes_the_waiter(pair):
    producer, consumer = pair
    block = bytes(range(256)) * 256  # 64 KiB
    reserved = consumer.reserve("req-7/k1", len(block))  # the consumer's region
    producer.put("req-7/k2", block)  # written already
    in_flight = producer.reserve("req-7/k3", len(block))  # being written
    producer.write_reserved(in_flight, block[:1000])
    out = {}
    t = threading.Thread(
        target=lambda: out.update(got=consumer.wait(["req-7/k1", "req-7/k3"], 60.0))
    )
    t.start()
    keys = ["req-7/k1", "req-7/k2", "req-7/k3"]
    assert producer.cancel(keys, "request aborted") == 3
    t.join(timeout=90)
    missing, failed = out["got"]
    assert missing == []
    assert sorted(failed) == [
        (b"req-7/k1", "request aborted"),
        (b"req-7/k3", "request aborted"),
    ]
    assert not consumer.exists("req-7/k2")
    for address in (reserved, in_flight):
        with pytest.raises(kvpool.Error, match="cancelled"):
            producer.commit_reserved(address, kvpool.checksum(block))
    assert producer.cancel(keys, "again") == 0
    with pytest.raises(kvpool.Error):
        producer.cancel(["req-7/k1"], "x" * 1025)  # a reason is at most 1 KiB
    producer.put("req-7/k2", block)  # the node keeps serving; a retry is a new request
    assert consumer.get("req-7/k2") == block


def test_a_deadline_the_node_cannot_meet_is_refused_up_front(start_kvpoold):
    # 16 MiB/s of bulk: 8 MiB takes about half a second.
    node = start_kvpoold(extra=["--bulk-rate", "16MiB"])
    big = bytes(range(256)) * (8 << 12)
    with kvpool.Client(node.url, same_host=False) as kv:
        kv.write("big", big)
        kv.write("small", b"s" * 4096)
    with kvpool.Client(
        node.url, same_host=False, priority="high", deadline=0.05
    ) as hurried:
        with pytest.raises(kvpool.TimeoutError, match="DeadlineUnmeetable|allowed"):
            hurried.read("big")
        # Small requests are never refused for a deadline.
        assert hurried.read("small") == b"s" * 4096
    with kvpool.Client(node.url, same_host=False, deadline=20.0) as patient:
        assert patient.read("big") == big


def test_bad_priorities_and_deadlines_are_refused(kvpoold):
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.Client(kvpoold.url, priority="urgent")
    for d in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(kvpool.InvalidArgumentError):
            kvpool.Client(kvpoold.url, deadline=d)


def test_a_consumer_reads_blocks_as_the_producer_writes_them(pair):
    producer, consumer = pair
    n, size = 6, 256 << 10
    keys = [f"req-stream/block-{i}".encode() for i in range(n)]
    blocks = [bytes([i]) * size for i in range(n)]
    buf = (ctypes.c_char * (n * size))()
    base = ctypes.addressof(buf)
    assert consumer.register_buffer(base, n * size) == 0

    def produce():
        for k, b in zip(keys[:-1], blocks):
            time.sleep(0.02)
            producer.write(k, b)
        producer.fail([keys[-1]], "prefill gave up")

    t = threading.Thread(target=produce)
    t.start()
    got, missing, failed = consumer.wait_get_into(
        keys, [base + i * size for i in range(n)], [size] * n, timeout=10.0
    )
    t.join()
    assert missing == [] and failed == [(keys[-1], "prefill gave up")]
    assert got == [size] * (n - 1) + [None]
    for i in range(n - 1):
        assert bytes(buf[i * size : (i + 1) * size]) == blocks[i]
    # Unregistered or overlapping buffers are refused before anything is read.
    with pytest.raises(kvpool.InvalidArgumentError):
        consumer.wait_get_into(keys[:2], [base, base + 8], [size, size], timeout=0.1)
    with pytest.raises(kvpool.InvalidArgumentError):
        consumer.wait_get_into(keys[:1], [12345], [size], timeout=0.1)

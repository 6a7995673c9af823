"""kvpool.events against a real kvpoold and vLLM's own KV event classes: blocks stored under
the kvpool.vllm connector's keys are published over ZMQ on loopback as vLLM's ``KVEventBatch``,
decoded by a SUB socket with vLLM's msgspec decoder, with the block hashes vLLM computed."""

from __future__ import annotations

import importlib
import socket
import threading
import time

import pytest
from conftest import require_module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def vllm_events():
    require_module("vllm.distributed.kv_events", "pip install vllm==0.33.0")
    return importlib.import_module("vllm.distributed.kv_events")


@pytest.fixture
def zmq():
    return require_module("zmq", "pip install pyzmq")


def block_hashes(n: int) -> list[bytes]:
    """The prefix-caching hashes vLLM computes for ``n`` full blocks of 16 tokens."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256_cbor)
    out: list[bytes] = []
    parent = None
    for b in range(n):
        parent = kcu.hash_block_tokens(
            sha256_cbor, parent, list(range(b * 16, b * 16 + 16))
        )
        out.append(bytes(parent))
    return out


class Running:
    """A publisher stepped on a thread of its own until stopped."""

    def __init__(self, pub) -> None:
        self.pub = pub
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.pub.step(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.pub.close()


def recv(sub, timeout: float = 10.0):
    assert sub.poll(int(timeout * 1000)), "no message in time"
    return sub.recv_multipart()


def test_blocks_in_the_pool_reach_a_vllm_subscriber(kvpoold, vllm_events, zmq):
    import kvpool
    from kvpool.engine import layout_salt
    from kvpool.events import VllmEventPublisher
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    client = kvpool.Client(kvpoold.url)
    port, replay_port = free_port(), free_port()
    pub = VllmEventPublisher(
        client,
        f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic="kv",
        block_size=16,
    )
    running = Running(pub)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        # The connector's key shape: "{salt}@{block_hash.hex()}", one per block and rank.
        salt = layout_salt(
            engine="vllm", model="m", block_size=16, tp_rank=0, tp_size=1
        )
        hashes = block_hashes(4)
        keys = [f"{salt}@{h.hex()}".encode() for h in hashes]
        # PUB drops what is sent before the SUB's subscription arrives: warm up first.
        deadline = time.monotonic() + 30
        while not sub.poll(100):
            assert time.monotonic() < deadline, (
                "the subscriber never heard the publisher"
            )
            client.put(keys[0], b"warm")
        while sub.poll(500):
            sub.recv_multipart()
        client.put(b"not-a-vllm-key", b"x")
        for k in keys:
            client.put(k, k * 8)
        assert client.delete(keys[1])
        client.clear()

        decoder = vllm_events_decoder(vllm_events)
        stored, removed, cleared, seqs = [], [], 0, []
        while not cleared:
            topic, seq, payload = recv(sub)
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            batch = decoder.decode(payload)
            assert isinstance(batch, vllm_events.KVEventBatch)
            for ev in batch.events:
                if isinstance(ev, vllm_events.BlockStored):
                    assert ev.medium == vllm_events.MEDIUM_CPU
                    assert ev.ownership == "kvpool"
                    assert ev.block_size == 16 and ev.parent_block_hash is None
                    stored.extend(ev.block_hashes)
                elif isinstance(ev, vllm_events.BlockRemoved):
                    assert ev.medium == vllm_events.MEDIUM_CPU
                    removed.extend(ev.block_hashes)
                else:
                    assert isinstance(ev, vllm_events.AllBlocksCleared)
                    cleared += 1
        want = [maybe_convert_block_hash(h) for h in hashes]
        assert stored == want, "one BlockStored per block, vLLM's hashes, in order"
        assert removed[0] == want[1], "the removed block first, then the clear's"
        assert sorted(removed[1:]) == sorted(want[:1] + want[2:])
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (
            "numbered without gaps"
        )
        assert pub.skipped == 2, "the key of no connector's shape: stored, then cleared"

        # Replay: every batch kept from a sequence number on, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", seqs[0].to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(10_000), "no replay"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append(int.from_bytes(seq, "big"))
            decoder.decode(payload)
        assert replayed == seqs
        dealer.close(0)
    finally:
        sub.close(0)
        running.close()
        client.close()


def vllm_events_decoder(vllm_events):
    import msgspec

    return msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)


def test_a_batch_with_dropped_events_starts_with_a_resync(vllm_events):
    import msgspec
    from kvpool.events import block_hash, to_vllm_events

    digest = bytes(range(32))
    key = b"0123456789abcdef@" + digest.hex().encode()
    assert block_hash(key) == int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert block_hash(key, hash_format="bytes") == digest
    assert block_hash(b"plain") is None
    assert block_hash(b"plain", unparsed="raw", hash_format="bytes") == b"plain"
    events, skipped = to_vllm_events(
        [("removed", "disk", key), ("removed", "disk", key), ("stored", "dram", b"x")],
        dropped=3,
    )
    assert skipped == 1
    payload = msgspec.msgpack.encode([0.0, events, None])
    batch = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(payload)
    assert isinstance(batch.events[0], vllm_events.AllBlocksCleared)
    assert isinstance(batch.events[1], vllm_events.BlockRemoved)
    assert batch.events[1].medium == vllm_events.MEDIUM_STORAGE
    assert len(batch.events[1].block_hashes) == 2


def test_offloading_tier_keys_give_the_block_hash_and_group(vllm_events):
    """A key of kvpool.vllm_offload (vLLM's offload key: block hash and group) is announced by
    the block hash alone, with its group, as vLLM's own classes decode it."""
    import msgspec
    from kvpool.events import block_hash, to_vllm_events
    from kvpool.vllm_offload import chunk_key
    from vllm.v1.kv_offload.base import make_offload_key

    digest = bytes(range(32))
    key = chunk_key("0123456789abcdef", make_offload_key(digest, 3)).encode()
    assert block_hash(key, hash_format="bytes") == digest
    events, skipped = to_vllm_events(
        [("stored", "dram", key), ("removed", "disk", key)], hash_format="bytes"
    )
    assert skipped == 0
    payload = msgspec.msgpack.encode([0.0, events, None])
    batch = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(payload)
    stored, removed = batch.events
    assert (stored.block_hashes, stored.group_idx) == ([digest], 3)
    assert (removed.block_hashes, removed.group_idx, removed.medium) == (
        [digest],
        3,
        "STORAGE",
    )

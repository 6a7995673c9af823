"""The pool's KV events in vLLM's KV event wire format, for cache-aware routers.

A router that consumes vLLM's KV events (vLLM's production-stack router, Dynamo's KV router,
llm-d's KV cache indexer) subscribes to a ZMQ PUB socket and decodes msgpack ``KVEventBatch``
messages. :class:`VllmEventPublisher` reads the pool's events (``Client.events``) and publishes
them the same way, so the blocks that left a GPU for the pool stay routable:

- framing as vLLM's ``ZmqEventPublisher``: multipart ``(topic, sequence number as 8 bytes
  big-endian, payload)``, one message per batch of the pool's events, numbered from 0; with a
  replay endpoint, a ROUTER socket answers ``(identity, b"", start sequence)`` with the kept
  batches from that number on, then ``(b"", -1 as 8 bytes, b"")``;
- payload: ``KVEventBatch`` (``[ts, events, data_parallel_rank]``), each event a tagged map:
  ``BlockStored`` (one per block, ``parent_block_hash`` None, ``token_ids`` empty: the pool
  does not know them), ``BlockRemoved`` (consecutive removals of one tier in one event) and
  ``AllBlocksCleared`` (a clear of the namespace, and the resynchronisation after the pool
  dropped events for this reader: the router forgets the pool's blocks and learns them again
  from the events that follow);
- ``medium``: ``"CPU"`` for the pool's memory, ``"STORAGE"`` for its disk tier; ``ownership``:
  ``"kvpool"``.

**Block hashes.** kvpool keys are opaque to the pool; this module turns each key into the block
hash the engine published, by the connectors' key schemes. ``kvpool.vllm``'s keys are
``"{salt}@{block_hash.hex()}"`` (one per block and rank): the hash is the bytes after the last
``@``; ``kvpool.vllm_offload``'s are ``"{salt}@{block_hash.hex()}:{group}"``, announced with
that ``group_idx``. As vLLM does by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), a hash is sent as
the integer of its bytes read big-endian, cut to 64 bits (``hash_format="bytes"`` sends the
bytes). A key of another shape is skipped (``unparsed="skip"``, the default, counted in
``skipped``) or sent as its own bytes (``unparsed="raw"``). Every rank's key of a block gives
the same hash: a block of a TP-2 engine is announced twice.

Needs ``msgspec`` and ``pyzmq`` (both come with vLLM). Run it beside a node::

    python -m kvpool.events --url tcp://127.0.0.1:7370 --namespace NS --zmq tcp://*:5557
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Iterable, Sequence
from typing import Any

try:
    import msgspec
    import zmq
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvpool.events needs msgspec and pyzmq (pip install msgspec pyzmq)"
    ) from e

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "OWNERSHIP",
    "VllmEventPublisher",
    "block_hash",
    "main",
    "to_vllm_events",
]

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
OWNERSHIP = "kvpool"

# The end-of-replay marker's sequence number, as vLLM's publisher sends it.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)

_MEDIUM = {"dram": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    ownership: str | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[bytes | int]
    medium: str | None
    ownership: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


def _parsed(key: bytes) -> tuple[bytes | None, int | None]:
    """The block hash's bytes a key names and its KV cache group, if it gives one: the hex after
    the last ``@``, and after a ``:`` the group (``kvpool.vllm_offload``'s keys)."""
    _, at, tail = key.rpartition(b"@")
    if not at:
        return None, None
    hexed, colon, group = tail.partition(b":")
    try:
        digest = bytes.fromhex(hexed.decode("ascii"))
        idx = int(group) if colon else None
    except (UnicodeDecodeError, ValueError):
        return None, None
    if idx is not None and idx < 0:
        return None, None
    return digest or None, idx


def block_hash(
    key: bytes, *, hash_format: str = "int", unparsed: str = "skip"
) -> bytes | int | None:
    """The vLLM block hash a kvpool key stands for (see the module docstring); None for a key
    of another shape when ``unparsed`` is ``"skip"``."""
    digest, _ = _parsed(key)
    if not digest:
        if unparsed != "raw":
            return None
        digest = key
    if hash_format == "bytes":
        return digest
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def to_vllm_events(
    events: Iterable[tuple[str, str, bytes]],
    *,
    dropped: int = 0,
    block_size: int = 16,
    hash_format: str = "int",
    unparsed: str = "skip",
) -> tuple[list[Any], int]:
    """The vLLM events of one batch of the pool's (``(kind, tier, key)`` each, as
    ``KvEvents.next`` gives them), and how many keys were skipped. A batch that reports dropped
    events starts with ``AllBlocksCleared``."""
    out: list[Any] = [_Cleared()] if dropped else []
    skipped = 0
    for kind, tier, key in events:
        if kind == "cleared":
            out.append(_Cleared())
            continue
        h = block_hash(key, hash_format=hash_format, unparsed=unparsed)
        if h is None:
            skipped += 1
            continue
        medium = _MEDIUM.get(tier, MEDIUM_CPU)
        group = _parsed(key)[1]
        if kind == "stored":
            out.append(
                _Stored(
                    block_hashes=[h],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    ownership=OWNERSHIP,
                    group_idx=group,
                )
            )
        elif (
            out
            and isinstance(out[-1], _Removed)
            and (out[-1].medium, out[-1].group_idx) == (medium, group)
        ):
            out[-1].block_hashes.append(h)
        else:
            out.append(
                _Removed(
                    block_hashes=[h],
                    medium=medium,
                    ownership=OWNERSHIP,
                    group_idx=group,
                )
            )
    return out, skipped


class VllmEventPublisher:
    """Publishes a pool's KV events (a ``kvpool.Client``'s ``events()``) on a ZMQ PUB socket in
    vLLM's KV event format; see the module docstring.

    ``endpoint`` and ``replay_endpoint`` are bound when they hold a ``*`` or are ``ipc://`` or
    ``inproc://`` addresses, connected otherwise (as vLLM's publisher does). ``buffer_steps``
    batches are kept for replay."""

    def __init__(
        self,
        client: Any,
        endpoint: str,
        *,
        prefix: bytes = b"",
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        block_size: int = 16,
        hash_format: str = "int",
        unparsed: str = "skip",
        data_parallel_rank: int | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        if hash_format not in ("int", "bytes"):
            raise ValueError(
                f"hash_format must be 'int' or 'bytes', not {hash_format!r}"
            )
        if unparsed not in ("skip", "raw"):
            raise ValueError(f"unparsed must be 'skip' or 'raw', not {unparsed!r}")
        self._events = client.events(prefix)
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        _attach(self._pub, endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            _attach(self._replay, replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_steps
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._options = {
            "block_size": block_size,
            "hash_format": hash_format,
            "unparsed": unparsed,
        }
        self._dp_rank = data_parallel_rank
        self.seq = 0
        """The sequence number the next message gets."""
        self.skipped = 0
        """Keys skipped because they are of no known connector's shape."""
        self.lagged = 0
        """Batches of the pool that reported dropped events (each sent as a resync)."""

    def publish(self, batch: Sequence[Any]) -> int | None:
        """Publishes one batch of the pool's (``(node, seq, dropped, events)``, as
        ``KvEvents.next`` gives it) as one ``KVEventBatch``: its sequence number, or None when
        nothing in it was for vLLM."""
        _node, _seq, dropped, events = batch
        out, skipped = to_vllm_events(events, dropped=dropped, **self._options)
        self.skipped += skipped
        self.lagged += bool(dropped)
        if not out:
            return None
        payload = self._encoder.encode(
            _Batch(ts=time.time(), events=out, data_parallel_rank=self._dp_rank)
        )
        seq = self.seq
        self.seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._kept.append((seq, payload))
        return seq

    def serve_replay(self) -> None:
        """Answers the replay requests waiting, if any (see the module docstring)."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client_id, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._kept:
                if seq >= first:
                    self._replay.send_multipart(
                        (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            self._replay.send_multipart((client_id, b"", b"", _END_SEQ, b""))

    def step(self, timeout: float = 0.1) -> int | None:
        """Serves replay requests, then publishes the pool's next batch if one comes within
        ``timeout`` seconds: its sequence number, or None."""
        self.serve_replay()
        batch = self._events.next(timeout)
        return None if batch is None else self.publish(batch)

    def run(self, stop_after: float | None = None) -> None:
        """Publishes until interrupted (or for ``stop_after`` seconds)."""
        end = None if stop_after is None else time.monotonic() + stop_after
        while end is None or time.monotonic() < end:
            self.step()

    def close(self) -> None:
        """Ends the subscription and closes the sockets."""
        self._events.close()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _attach(sock: zmq.Socket, endpoint: str) -> None:
    if (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    ):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m kvpool.events``: publishes a namespace's events until interrupted."""
    p = argparse.ArgumentParser(
        prog="python -m kvpool.events",
        description="Publish a kvpool namespace's KV events in vLLM's ZMQ KVEventBatch format.",
    )
    p.add_argument("--url", default="tcp://127.0.0.1:7370", help="a node of the pool")
    p.add_argument("--namespace", default=None, help="the namespace (default: default)")
    p.add_argument("--token", default=None, help="a token that may read the namespace")
    p.add_argument("--prefix", default="", help="only keys that start with this")
    p.add_argument("--zmq", default="tcp://*:5557", help="the PUB socket's endpoint")
    p.add_argument(
        "--replay", default=None, help="a ROUTER endpoint for replay requests"
    )
    p.add_argument("--topic", default="", help="the topic frame of every message")
    p.add_argument("--block-size", type=int, default=16, help="block size to announce")
    p.add_argument("--hash-format", choices=("int", "bytes"), default="int")
    p.add_argument(
        "--unparsed",
        choices=("skip", "raw"),
        default="skip",
        help="keys of no known connector's shape: skipped, or sent as their bytes",
    )
    args = p.parse_args(argv)
    from . import Client

    client = Client(args.url, namespace=args.namespace, token=args.token)
    pub = VllmEventPublisher(
        client,
        args.zmq,
        prefix=args.prefix.encode(),
        topic=args.topic,
        replay_endpoint=args.replay,
        block_size=args.block_size,
        hash_format=args.hash_format,
        unparsed=args.unparsed,
    )
    try:
        pub.run()
    except KeyboardInterrupt:
        pass
    finally:
        pub.close()


if __name__ == "__main__":
    main()

"""Type stubs of kvpool's native extension (built from python/src with PyO3). Use it through
``kvpool.Client``; the underscored methods are the engine of its Pythonic calls."""

import os
from collections.abc import Sequence
from typing import Any, TypeAlias

Key: TypeAlias = str | bytes

MAX_KEY_LEN: int
"""The longest key, in bytes (256). A ``str`` key counts its UTF-8 bytes."""

def _checksum_unchecked(ptr: int, len: int) -> int: ...
def block_hashes(
    token_ids: Sequence[int],
    block_tokens: int = 16,
    *,
    tenant: str = "",
    model: str = "",
    dtype: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_stage: int = 0,
    layer_start: int = 0,
    layer_end: int = 0,
    salt: str | None = None,
) -> list[bytes]:
    """The 16-byte keys of the full ``block_tokens``-token blocks of ``token_ids``, exactly as
    docs/HASHING.md specifies (key ``i`` covers blocks 0 to ``i``; a partial last block has no
    key). Raises ValueError for ``block_tokens == 0`` and OverflowError for a token outside
    0..2**32."""

class Client:
    """A kvpool client (see ``kvpool.Client``)."""

    def __init__(
        self,
        endpoint: str,
        namespace: str | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        same_host: bool = True,
        priority: str = "normal",
        deadline: float | None = None,
        local_index: int = 65536,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        """Connects to ``endpoint`` (``tcp://host:port``, ``tls://host:port``,
        ``quic://host:port``, ``unix:///path`` or ``host:port``; ``tls://`` and ``quic://``
        trust the PEM certificate file ``ca``). Every call fails within ``timeout`` seconds when
        the node does not answer. ``same_host=False`` turns the same-host path off.
        ``priority``: the client's share of bulk transfers (``"background"``, ``"low"``,
        ``"normal"``, ``"high"``); ``deadline``: seconds every call carries, a bulk transfer
        that can't be done in time being refused at once (``kvpool.TimeoutError``). Raises ``kvpool.ConnectionError`` (unreachable),
        ``kvpool.AuthError`` (token or namespace refused), ``kvpool.InvalidArgumentError``
        (bad endpoint or timeout)."""
    @property
    def endpoint(self) -> str:
        """The endpoint the client was given."""
    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
    def is_local(self) -> bool:
        """True when the node runs on this host and its memory is mapped into this process:
        a get into a caller's buffer is then one copy, with no socket round trip per value."""
    def unreachable_events(self) -> int:
        """How many times a node could not be reached and a request's keys on it were answered
        as misses (lookups, gets and ``match_prefix`` do that rather than raise). Compare it
        before and after a call to tell an unreachable node from a miss."""
    def stats(self) -> dict[str, Any]:
        """The connected node's statistics, per tier: DRAM's (``objects``, ``hits``,
        ``misses``, ``evictions``, ``segments``, ``namespaces``, ...) and, under ``disk``, the
        disk tier's (None when the node has none)."""
    def health_check(self) -> int:
        """0 when the node answers, 1 when the client is closed, 2 when the node can't be
        reached within the timeout."""
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers ``size`` bytes at address ``buffer_ptr`` (e.g. ``arr.ctypes.data`` or a
        torch tensor's ``data_ptr()``) for ``get_into``/``put_from`` and their batch forms.
        The memory must stay valid while registered. Returns 0, or -600 for a null pointer,
        a zero size or a closed client."""
    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Drops the registration starting at ``buffer_ptr``. Returns 0, or -600 when there
        is none."""
    def get_into(self, key: Key, buffer_ptr: int, size: int) -> int:
        """Copies the value of ``key`` into registered memory. Returns its length, or -704
        (not found), -10 (buffer smaller than the value), -600 (range not inside a
        registration, or closed), -400 (bad key), -900 (node unreachable)."""
    def put_from(self, key: Key, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Stores ``size`` bytes of registered memory under ``key``. Returns 0, or -600,
        -400, -200 (no room), -900. ``config`` is accepted and ignored."""
    def batch_get_into(
        self, keys: Sequence[Key], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``get_into`` for many keys in one round trip per node: per key its length or a
        negative status (overlapping destination ranges are refused with -600)."""
    def get_size(self, key: Key) -> int:
        """The length of ``key``'s value, or -704 (not found), -400 (bad key), -600 (closed),
        -900 (node unreachable). Mooncake's ``get_size``."""
    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        all_keys: Sequence[Sequence[Key]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:
        """Mooncake's ``get_into_ranges``: per buffer ``i``, key ``j`` and fragment ``k``,
        ``all_sizes[i][j][k]`` bytes at ``all_src_offsets[i][j][k]`` of ``all_keys[i][j]``'s
        value into registered memory at ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``. The
        same nesting back: per fragment the bytes copied, or -704 (key missing), -600 (a range
        outside the value or a registration, or lists of different lengths), -400 (bad key).
        Each distinct key's whole value is fetched once and verified before it is cut."""
    def batch_get_scatter(
        self, keys: Sequence[Key], pieces: Sequence[Sequence[tuple[int, int]]]
    ) -> list[int]:
        """``batch_get_into`` with each value filling several registered ``(pointer, length)``
        pieces in order (an object holding every layer of a KV block, into per-layer pages):
        per key its length or a negative status. No staging copy: on the same host copied
        from kvpoold's memory, otherwise received from the socket straight into the pieces."""
    def batch_put_from(
        self,
        keys: Sequence[Key],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: Any = None,
    ) -> list[int]:
        """``put_from`` for many keys in one round trip per node: one status per key."""
    def exists(self, key: Key) -> bool:
        """True when ``key`` is present. Raises ``kvpool.Error`` subclasses."""
    def wait(
        self, keys: Sequence[Key], timeout: float
    ) -> tuple[list[bytes], list[tuple[bytes, str]]]:
        """Handoff: waits until every key is written, or failed by its producer, for at most
        ``timeout`` seconds, without polling. Returns ``(missing, failed)``: the keys not
        written by then, and ``(key, reason)`` for the keys whose producer called
        :meth:`fail`. Both empty: every key is there."""
    def wait_get_into(
        self,
        keys: Sequence[Key],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        timeout: float,
    ) -> tuple[list[int | None], list[bytes], list[tuple[bytes, str]]]:
        """Handoff: :meth:`wait` that also reads each key into its registered buffer the
        moment it is written, while the producer writes the rest (the reads overlap the
        writes). Returns ``(sizes, missing, failed)``: per key the bytes read or None, the keys
        not written by the deadline, and ``(key, reason)`` for the failed ones. Buffers must
        lie in registered memory and not overlap (``InvalidArgumentError``)."""
    def subscribe(self, prefix: Key) -> Subscription:
        """Handoff: events for every key under ``prefix`` (at most 256 bytes; empty: every
        key), from the nodes serving now."""
    def expire(self, keys: Sequence[Key], ttl: float) -> int:
        """Handoff lease on ``keys``, written yet or not (a producer leases before it writes):
        every copy of each is removed ``ttl`` seconds from now unless renewed (call again) or
        ended (``ttl`` 0). Returns how many keys are present."""
    def _reserve(self, key: Key, length: int) -> bytes: ...
    def _write_reserved_unchecked(
        self, address: bytes, offset: int, ptr: int, len: int
    ) -> None: ...
    def _commit_reserved(self, address: bytes, checksum: int) -> None: ...
    def _abort_reserved(self, address: bytes) -> None: ...
    def fail(self, keys: Sequence[Key], reason: str) -> int:
        """Handoff: the producer gives up on ``keys``; every :meth:`wait` for them returns at
        once with ``reason``. Returns how many tombstones were posted."""
    def cancel(self, keys: Sequence[Key], reason: str) -> int:
        """Handoff: aborts a request on both sides in one call: each key's objects are removed
        (pinned too), its pending reservations and writes released (a later
        :meth:`commit_reserved` fails), its lease dropped, and every :meth:`wait` for it returns
        at once with ``reason`` (at most 1 KiB). Returns how many objects and reservations were
        freed."""
    def events(self, prefix: Key | None = None) -> KvEvents:
        """KV events for routers: batches of the keys of the namespace under ``prefix`` (at
        most 256 bytes; None or empty: every key) stored in or removed from a tier of every
        node serving now (see ``KvEvents.next``)."""
    def delete(self, key: Key) -> bool:
        """Removes ``key``; True when an object was removed. Raises ``kvpool.Error``
        subclasses."""
    def clear(self) -> int:
        """Removes every object of the client's namespace on every node, pinned ones too;
        returns how many were removed. One round trip per node. Raises ``kvpool.Error``
        subclasses (``ConnectionError`` when a node can't be reached: its objects stay)."""
    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of ``keys`` are present (the part of a prefix that can be
        loaded): one round trip per node owning any of them. Raises ``kvpool.Error``
        subclasses."""
    def _close(self) -> None: ...
    def _write_bytes(self, key: Key, data: bytes) -> None: ...
    def _write_unchecked(self, key: Key, address: int, length: int) -> None: ...
    def _read(self, key: Key) -> bytes | None: ...
    def _read_into_unchecked(
        self, key: Key, address: int, length: int
    ) -> int | None: ...
    def _read_many_into_unchecked(
        self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int]
    ) -> list[int | None]: ...
    def _write_many_unchecked(
        self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int]
    ) -> None: ...
    def _presence(self, keys: Sequence[Key]) -> list[bool]: ...

# ----- model weights: the engine of kvpool.weights (see there and docs/WEIGHTS.md) -----

class Subscription:
    """Keys under a prefix as they are written or failed (``Client.subscribe``)."""

    def next(
        self, timeout: float
    ) -> tuple[str] | tuple[str, bytes] | tuple[str, bytes, str] | None:
        """The next event within ``timeout`` seconds: ``("written", key)``,
        ``("failed", key, reason)``, ``("lagged",)`` (events were dropped: look the keys up
        again), or None."""
    def close(self) -> None:
        """Ends the subscription."""

class KvEvents:
    """A subscription to the pool's KV events (``Client.events``); iterating it waits for
    each batch (Ctrl-C interrupts)."""

    def next(
        self, timeout: float
    ) -> tuple[int, int, int, list[tuple[str, str, bytes]]] | None:
        """The next batch within ``timeout`` seconds, the GIL released:
        ``(node, seq, dropped, events)``, each event ``(kind, tier, key)`` with kind
        ``"stored"``, ``"removed"`` or ``"cleared"`` and tier ``"dram"`` or ``"disk"``.
        ``seq`` numbers the node's events for this subscription (dropped ones too);
        ``dropped`` > 0 is the lag marker: events were lost, resynchronise. None when nothing
        came in time or the subscription is closed."""
    def __iter__(self) -> KvEvents: ...
    def __next__(self) -> tuple[int, int, int, list[tuple[str, str, bytes]]]: ...
    def close(self) -> None:
        """Ends the subscription."""

class WeightsModel:
    """A published model's manifest, parsed once (``kvpool.weights.Manifest`` wraps it)."""

    @staticmethod
    def from_json(json: str) -> WeightsModel:
        """Parses a manifest as stored in the pool. Raises ``kvpool.InvalidArgumentError``."""
    def json(self) -> str:
        """The manifest's JSON, as stored in the pool."""
    @property
    def name(self) -> str:
        """The model's name."""
    def chunk_keys(self) -> list[tuple[int, int, int, bytes]]:
        """(file index, tensor index, chunk index, key) of every chunk."""

def _weights_publish(
    client: Client,
    namespace: str,
    name: str,
    paths: Sequence[str],
    chunk_size: int | None = None,
    replicas: int | None = None,
) -> WeightsModel: ...
def _weights_manifest(
    client: Client, namespace: str, name: str
) -> WeightsModel | None: ...
def _weights_list(client: Client, namespace: str) -> list[str]: ...
def _weights_remove(client: Client, namespace: str, name: str) -> bool: ...
def _weights_load_into_unchecked(
    client: Client,
    namespace: str,
    model: WeightsModel,
    targets: Sequence[tuple[int, int, int, int]],
    source_dir: str | None = None,
    source_files: Sequence[str] | None = None,
) -> dict[str, int]:
    """Loads whole tensors into (file index, tensor index, address, length) targets. Private:
    the caller holds every buffer exported for the call."""

class WeightsViews:
    """Owner of same-host zero-copy views of tensors: the pool's memory mapped read-only, the
    chunks held on their nodes until the last reference goes."""

    @property
    def connections(self) -> int:
        """Connections keeping the holds (one per node of this host asked)."""

def _weights_view(
    client: Client,
    namespace: str,
    model: WeightsModel,
    targets: Sequence[tuple[int, int]],
    verify: bool,
) -> tuple[WeightsViews, list[tuple[int, int] | None]]:
    """Views of (file index, tensor index) targets: the owner, and per target its (address,
    length), read-only and valid while the owner lives, or None where it must be copied."""

def _weights_slice(
    client: Client,
    namespace: str,
    model: WeightsModel,
    tensor: str,
    dim: int,
    rank: int,
    world: int,
) -> tuple[bytearray, list[int]]: ...
def _weights_extra(
    client: Client, namespace: str, model: WeightsModel, index: int
) -> bytes: ...
def _weights_write_files(
    client: Client,
    namespace: str,
    model: WeightsModel,
    dir: str,
    source_dir: str | None = None,
) -> dict[str, int]: ...
def _weights_stats(
    client: Client, namespace: str, model: WeightsModel
) -> dict[str, Any]: ...

"""kvpool: the Python client of kvpool, a distributed memory pool for LLM serving.

``kvpool.Client`` speaks two dialects over one thread-safe connection pool:

* Mooncake Store's Python API (``put``, ``get``, ``is_exist``, ``batch_is_exist``,
  ``register_buffer``, ``unregister_buffer``, ``put_from``, ``get_into``, ``batch_put_from``,
  ``batch_get_into``, ``remove``, ``remove_all``, ``health_check``, ``close``) with its return
  conventions: status codes, never exceptions for a store failure. Code written for
  ``MooncakeDistributedStore`` switches by changing its constructor.
* Pythonic calls that take any buffer-protocol object (bytes, bytearray, memoryview, numpy
  arrays) and raise :class:`kvpool.Error` subclasses: ``write``, ``read``, ``read_into``,
  ``write_many``, ``read_many_into``, ``exists``, ``delete``, ``match_prefix``.

Every call that waits on the network releases the GIL. Where kvpoold runs on the same host, the
client maps its memory and a get into a caller's buffer is one copy, with no socket round trip
per value. See docs/PYTHON.md.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar, Union

from . import _errors, _native
from ._errors import (
    AuthError,
    BufferTooSmallError,
    ClosedError,
    ConnectionError,
    Error,
    InvalidArgumentError,
    InvalidKeyError,
    NotFoundError,
    PoolFullError,
    TimeoutError,
    TooLargeError,
    UnsupportedError,
)
from ._native import MAX_KEY_LEN, KvEvents, block_hashes
from ._native import Client as _NativeClient

__all__ = [
    "MAX_KEY_LEN",
    "AuthError",
    "BufferTooSmallError",
    "Client",
    "ClosedError",
    "ConnectionError",
    "Error",
    "InvalidArgumentError",
    "InvalidKeyError",
    "KvEvents",
    "NotFoundError",
    "PoolFullError",
    "TimeoutError",
    "TooLargeError",
    "UnsupportedError",
    "block_hashes",
    "checksum",
]

Key = Union[str, bytes]  # noqa: UP007 (evaluated at import: Python 3.9 has no `str | bytes`)
_C = TypeVar("_C", bound="Client")


def _writable(buf: Any) -> tuple[int, int, Any]:
    """(address, length, holder) of a writable, C-contiguous buffer. ``holder`` keeps the
    buffer exported, so it can't be freed or resized until it is dropped."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidArgumentError(
            f"{type(buf).__name__} does not support the buffer protocol "
            "(for a torch tensor use register_buffer(t.data_ptr(), t.nbytes) and get_into)"
        ) from None
    if mv.readonly:
        raise InvalidArgumentError(
            "a get needs a writable buffer; this one is read-only"
        )
    if not mv.c_contiguous:
        raise InvalidArgumentError("the buffer must be C-contiguous")
    n = mv.nbytes
    if n == 0:
        return 0, 0, mv
    holder = (ctypes.c_char * n).from_buffer(mv)
    return ctypes.addressof(holder), n, holder


def _readable(buf: Any) -> tuple[int, int, Any]:
    """(address, length, holder) of a C-contiguous buffer to store. A read-only buffer that is
    not ``bytes`` (ctypes exports only writable ones) is copied once into bytes."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidArgumentError(
            f"{type(buf).__name__} does not support the buffer protocol "
            "(for a torch tensor use register_buffer(t.data_ptr(), t.nbytes) and put_from)"
        ) from None
    if not mv.c_contiguous:
        raise InvalidArgumentError("the buffer must be C-contiguous")
    n = mv.nbytes
    if n == 0:
        return 0, 0, mv
    if mv.readonly:
        data = buf if isinstance(buf, bytes) else mv.tobytes()
        holder = ctypes.c_char_p(data)
        return ctypes.cast(holder, ctypes.c_void_p).value or 0, n, (data, holder)
    holder = (ctypes.c_char * n).from_buffer(mv)
    return ctypes.addressof(holder), n, holder


def checksum(value: Any) -> int:
    """xxh3-64 of a buffer's bytes, the checksum a node checks a value against (what
    :meth:`Client.commit_reserved` takes)."""
    addr, n, holder = _readable(value)
    try:
        return _native._checksum_unchecked(addr, n)
    finally:
        del holder


class Client(_NativeClient):
    """A kvpool client: thread-safe (share one per process) and a context manager.

    ``Client(endpoint, namespace=None, token=None, timeout=10.0, same_host=True,
    priority="normal", deadline=None, local_index=65536, ca=None)`` connects to the node at
    ``endpoint`` (``tcp://host:port``, ``tls://host:port``, ``quic://host:port``,
    ``unix:///path`` or ``host:port``; ``tls://`` and ``quic://`` trust the PEM certificate
    file ``ca``, e.g. the node's generated ``<data dir>/tls-cert.pem``), in ``namespace`` (``"default"`` when None) with ``token``; every call fails
    within ``timeout`` seconds when the node does not answer; ``same_host=False`` turns the
    same-host path off (every byte over the endpoint's transport, as from another host);
    ``priority`` (``"background"``, ``"low"``, ``"normal"``, ``"high"``) is the client's share of
    the nodes' bulk transfers (large values and batches); with ``deadline`` (seconds) every call
    carries it, and a node refuses at once a bulk transfer it estimates it can't finish in time
    (:class:`TimeoutError`, so the engine recomputes instead of waiting); on the same host the
    client remembers where it found up to ``local_index`` keys and reads them again without a
    lookup round trip (each read checked as the key's current value; 0 turns it off). Raises :class:`ConnectionError`
    when the node can't be reached and :class:`AuthError` when it refuses the token or the
    namespace.
    """

    def __enter__(self: _C) -> _C:  # noqa: PYI019 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- Mooncake Store's API: status codes -----

    def close(self) -> int:
        """Closes the client; later calls fail with status -600 / :class:`ClosedError`.
        Returns 0 (closing twice is harmless)."""
        self._close()
        return 0

    def put(self, key: Key, value: Any, config: Any = None) -> int:
        """Stores ``value`` (any buffer) under ``key``. Returns 0, or a negative status
        (-400 bad key, -200 no room, -600 closed or not a buffer, -900 unreachable).
        ``config`` (Mooncake's ReplicateConfig) is accepted and ignored."""
        try:
            self.write(key, value)
            return 0
        except Error as e:
            return e.code

    def get(self, key: Key) -> bytes:
        """The value of ``key``; empty bytes when it is missing or on any error (Mooncake's
        convention)."""
        try:
            v = self._read(key)
        except Error:
            return b""
        return b"" if v is None else v

    def is_exist(self, key: Key) -> int:
        """1 when ``key`` is present, 0 when not, a negative status on error."""
        try:
            return 1 if self.exists(key) else 0
        except Error as e:
            return e.code

    def batch_is_exist(self, keys: Sequence[Key]) -> list[int]:
        """Per key: 1 present, 0 missing, or a negative status (for every key when the call
        fails). One round trip per node."""
        keys = list(keys)
        try:
            return [1 if p else 0 for p in self._presence(keys)]
        except Error as e:
            return [e.code] * len(keys)

    def remove(self, key: Key, force: bool = False) -> int:
        """Removes ``key``. Returns 0, -704 when there was no such object, or a negative
        status. ``force`` is accepted and ignored (kvpool leases never block a remove)."""
        try:
            return 0 if self.delete(key) else _errors.OBJECT_NOT_FOUND
        except Error as e:
            return e.code

    def remove_all(self, force: bool = False) -> int:
        """Removes every object of the client's namespace on every node (pinned ones too)
        and returns how many, or a negative status (-900 when a node can't be reached: its
        objects stay). ``force`` is accepted and ignored (kvpool leases never block a
        remove)."""
        try:
            return self.clear()
        except Error as e:
            return e.code

    # ----- Pythonic calls: buffers and exceptions -----

    def write(self, key: Key, value: Any) -> None:
        """Stores ``value`` (bytes, bytearray, memoryview, a C-contiguous numpy array: any
        buffer) under ``key``. Raises :class:`InvalidKeyError`, :class:`TooLargeError`,
        :class:`PoolFullError`, :class:`ConnectionError`, :class:`ClosedError`."""
        if type(value) is bytes:
            self._write_bytes(key, value)
            return
        addr, n, holder = _readable(value)
        try:
            self._write_unchecked(key, addr, n)
        finally:
            del holder

    # ----- one-sided handoff: the consumer reserves, the producer writes and commits -----

    def reserve(self, key: Key, length: int) -> bytes:
        """Reserves ``length`` bytes for ``key`` on its owner (invisible until committed, and
        reclaimed by the node if not committed within its ``pending_timeout_ms``). Returns the
        address as bytes: hand it to the producer, which writes with :meth:`write_reserved`
        and commits with :meth:`commit_reserved`; :meth:`wait` on ``key`` returns then."""
        return self._reserve(key, length)

    def write_reserved(self, address: bytes, value: Any, offset: int = 0) -> None:
        """Writes ``value`` (any buffer) at ``offset`` of a reserved address: a direct store
        on the same host, a one-sided write otherwise. Raises :class:`InvalidArgumentError`
        for bytes that are not an address, and the node's refusal (wrong memory key, out of
        bounds, already committed) as :class:`Error`."""
        addr, n, holder = _readable(value)
        try:
            self._write_reserved_unchecked(address, offset, addr, n)
        finally:
            del holder

    def commit_reserved(self, address: bytes, checksum: int) -> None:
        """Makes the reserved bytes the value of their key once the node has checked they hash
        to ``checksum`` (:func:`kvpool.checksum` of the whole value); waiters wake."""
        self._commit_reserved(address, checksum)

    def abort_reserved(self, address: bytes) -> None:
        """Gives a reserved address back without committing it."""
        self._abort_reserved(address)

    def read(self, key: Key) -> bytes:
        """The value of ``key``. Raises :class:`NotFoundError` when it is missing."""
        v = self._read(key)
        if v is None:
            raise NotFoundError(f"no object under {key!r}")
        return v

    def read_into(self, key: Key, buffer: Any) -> int:
        """Copies the value of ``key`` into ``buffer`` (writable, C-contiguous: bytearray,
        memoryview, numpy array) and returns its length; on the same host this is the only
        copy. Raises :class:`NotFoundError`, :class:`BufferTooSmallError` (nothing copied),
        :class:`InvalidArgumentError` for a read-only or non-contiguous buffer."""
        addr, n, holder = _writable(buffer)
        try:
            got = self._read_into_unchecked(key, addr, n)
        finally:
            del holder
        if got is None:
            raise NotFoundError(f"no object under {key!r}")
        return got

    def read_many_into(
        self, keys: Sequence[Key], buffers: Sequence[Any]
    ) -> list[int | None]:
        """``read_into`` for many keys at once (``buffers[i]`` for ``keys[i]``), one round trip
        per node: per key its length, or None for a miss. Raises on a failure of the whole
        call, and :class:`BufferTooSmallError` when a buffer is too small."""
        keys = list(keys)
        buffers = list(buffers)
        if len(keys) != len(buffers):
            raise InvalidArgumentError("one buffer per key")
        held = [_writable(b) for b in buffers]
        try:
            return self._read_many_into_unchecked(
                keys, [h[0] for h in held], [h[1] for h in held]
            )
        finally:
            del held

    def write_many(self, keys: Sequence[Key], values: Iterable[Any]) -> None:
        """``write`` for many keys at once (``values[i]`` under ``keys[i]``), one round trip
        per node. Raises the first failure."""
        keys = list(keys)
        held = [_readable(v) for v in values]
        if len(keys) != len(held):
            raise InvalidArgumentError("one value per key")
        try:
            self._write_many_unchecked(keys, [h[0] for h in held], [h[1] for h in held])
        finally:
            del held

    def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        """Per key, whether it is present (one round trip per node)."""
        return self._presence(list(keys))

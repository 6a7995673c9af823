"""kvpool's exceptions, raised by the Pythonic calls (``read``, ``write``, ``read_into``, ...).

Every exception carries ``code``: the negative status the Mooncake-compatible call of the same
operation returns instead of raising (Mooncake Store's ``ErrorCode`` values, see
docs/PYTHON.md). The native extension raises these classes directly.
"""

from __future__ import annotations

import builtins

# Mooncake Store's status codes (mooncake-store/include/types.h), the ones kvpool returns.
OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900
UNAVAILABLE_IN_CURRENT_MODE = -1011


class Error(Exception):
    """Base of every kvpool error. ``code`` is the Mooncake-style status of the failure."""

    code: int = INTERNAL_ERROR


class ConnectionError(Error, builtins.ConnectionError):
    """The node could not be reached, or stopped answering (the client reconnects on its own
    when it comes back)."""

    code = RPC_FAIL


class TimeoutError(ConnectionError):
    """The call did not finish within the client's ``timeout``."""

    code = RPC_FAIL


class AuthError(Error, PermissionError):
    """The token was refused, or the namespace does not exist or is not the token's."""

    code = ILLEGAL_CLIENT


class NotFoundError(Error, KeyError):
    """No object under that key (never stored, removed, or evicted)."""

    code = OBJECT_NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class TooLargeError(Error, ValueError):
    """The value is larger than the pool can ever hold."""

    code = NO_AVAILABLE_HANDLE


class PoolFullError(Error):
    """Nothing left to evict, or the namespace's quota is held by objects that can't be
    evicted."""

    code = NO_AVAILABLE_HANDLE


class BufferTooSmallError(Error, ValueError):
    """The destination buffer is smaller than the value (nothing was copied)."""

    code = BUFFER_OVERFLOW


class InvalidKeyError(Error, ValueError):
    """A key must be 1 to 256 bytes (a ``str`` counts its UTF-8 bytes)."""

    code = INVALID_KEY


class InvalidArgumentError(Error, ValueError):
    """A bad argument: a read-only or non-contiguous buffer given to a get, a null or
    unregistered pointer, lists of different lengths, a bad endpoint."""

    code = INVALID_PARAMS


class ClosedError(Error):
    """The client was closed."""

    code = INVALID_PARAMS


class UnsupportedError(Error):
    """The operation is not offered by kvpool (see docs/PYTHON.md)."""

    code = UNAVAILABLE_IN_CURRENT_MODE


_BY_CODE: dict[int, type[Error]] = {
    BUFFER_OVERFLOW: BufferTooSmallError,
    NO_AVAILABLE_HANDLE: PoolFullError,
    INVALID_KEY: InvalidKeyError,
    INVALID_PARAMS: InvalidArgumentError,
    ILLEGAL_CLIENT: AuthError,
    OBJECT_NOT_FOUND: NotFoundError,
    RPC_FAIL: ConnectionError,
    UNAVAILABLE_IN_CURRENT_MODE: UnsupportedError,
}


def from_code(code: int, what: str) -> Error:
    """The exception for a Mooncake-style status ``code`` (a negative number)."""
    cls = _BY_CODE.get(code, Error)
    err = cls(f"{what}: status {code}")
    err.code = code
    return err

"""Bad input never crashes the interpreter: each case is a clear exception (Pythonic calls) or
the documented status code (Mooncake-compatible calls)."""

from __future__ import annotations

import ctypes

import kvpool
import pytest
from conftest import require_module


@pytest.fixture
def kv(kvpoold):
    with kvpool.Client(kvpoold.url, timeout=10.0) as c:
        yield c


def test_buffer_smaller_than_the_value(kv):
    kv.write("big", b"x" * 1000)
    small = bytearray(999)
    with pytest.raises(kvpool.BufferTooSmallError) as e:
        kv.read_into("big", small)
    assert e.value.code == -10
    assert small == bytearray(999)  # nothing copied
    buf = (ctypes.c_char * 999)()
    assert kv.register_buffer(ctypes.addressof(buf), 999) == 0
    assert kv.get_into("big", ctypes.addressof(buf), 999) == -10
    # In a batch only the small buffer's item fails.
    ok = bytearray(1000)
    assert (
        kv.register_buffer(ctypes.addressof((ctypes.c_char * 1).from_buffer(ok)), 1000)
        == 0
    )
    okp = ctypes.addressof((ctypes.c_char * 1).from_buffer(ok))
    assert kv.batch_get_into(
        ["big", "big"], [okp, ctypes.addressof(buf)], [1000, 999]
    ) == [
        1000,
        -10,
    ]
    with pytest.raises(kvpool.BufferTooSmallError):
        kv.read_many_into(["big", "big"], [bytearray(1000), bytearray(10)])


def test_read_only_buffer_given_to_a_get(kv):
    np = require_module("numpy", "pip install numpy")
    kv.write("k", b"abc")
    for ro in (b"\0" * 8, memoryview(bytearray(8)).toreadonly()):
        with pytest.raises(kvpool.InvalidArgumentError) as e:
            kv.read_into("k", ro)
        assert e.value.code == -600
    arr = np.zeros(8, dtype=np.uint8)
    arr.flags.writeable = False
    with pytest.raises(kvpool.InvalidArgumentError):
        kv.read_into("k", arr)
    with pytest.raises(kvpool.InvalidArgumentError):
        kv.read_into("k", np.zeros((4, 4), dtype=np.uint8)[:, ::2])  # not contiguous
    with pytest.raises(kvpool.InvalidArgumentError):
        kv.read_into("k", object())
    with pytest.raises(kvpool.InvalidArgumentError):
        kv.write("k", 12345)


def test_null_unregistered_and_out_of_range_pointers(kv):
    kv.write("k", b"value")
    buf = (ctypes.c_char * 64)()
    p = ctypes.addressof(buf)
    # Nothing registered yet: refused, never dereferenced.
    assert kv.get_into("k", p, 64) == -600
    assert kv.put_from("k", p, 64) == -600
    assert kv.get_into("k", 0, 64) == -600
    assert kv.put_from("k", 0, 0) == -600
    assert kv.register_buffer(0, 64) == -600
    assert kv.register_buffer(p, 0) == -600
    assert kv.unregister_buffer(p) == -600
    assert kv.register_buffer(p, 64) == 0
    assert kv.get_into("k", p, 64) == 5
    # A range that runs past the registration, or starts before it.
    assert kv.get_into("k", p + 1, 64) == -600
    assert kv.get_into("k", p - 1, 8) == -600
    assert kv.put_from("k", p, 65) == -600
    assert kv.get_into("k", 2**64 - 8, 64) == -600  # wraps the address space
    assert kv.batch_get_into(["k", "k"], [p, 0], [8, 8]) == [5, -600]
    assert kv.batch_put_from(["a", "b"], [p, 12345], [8, 8]) == [0, -600]
    assert kv.batch_get_into(["k"], [p, p], [8]) == [-600]  # lists of different lengths
    with pytest.raises(OverflowError):
        kv.get_into("k", -1, 8)
    # After unregistering, the same pointer is refused again.
    assert kv.unregister_buffer(p) == 0
    assert kv.get_into("k", p, 64) == -600


def test_key_over_the_limit_and_empty_key(kv):
    long = "k" * (kvpool.MAX_KEY_LEN + 1)
    for key in (long, "", b""):
        with pytest.raises(kvpool.InvalidKeyError) as e:
            kv.write(key, b"v")
        assert e.value.code == -400
        with pytest.raises(kvpool.InvalidKeyError):
            kv.read(key)
        assert kv.put(key, b"v") == -400
        assert kv.is_exist(key) == -400
        assert kv.get(key) == b""
    assert kv.put("k" * kvpool.MAX_KEY_LEN, b"v") == 0  # the limit itself is fine
    # Three UTF-8 bytes per "€": 86 of them are 258 bytes, though only 86 characters.
    with pytest.raises(kvpool.InvalidKeyError):
        kv.write("€" * 86, b"v")
    with pytest.raises(TypeError):
        kv.write(42, b"v")
    buf = (ctypes.c_char * 8)()
    kv.register_buffer(ctypes.addressof(buf), 8)
    assert kv.get_into(long, ctypes.addressof(buf), 8) == -400
    assert kv.batch_put_from([long], [ctypes.addressof(buf)], [8]) == [-400]


def test_closed_client(kvpoold):
    kv = kvpool.Client(kvpoold.url)
    buf = (ctypes.c_char * 8)()
    assert kv.register_buffer(ctypes.addressof(buf), 8) == 0
    assert kv.close() == 0
    with pytest.raises(kvpool.ClosedError) as e:
        kv.write("k", b"v")
    assert e.value.code == -600
    with pytest.raises(kvpool.ClosedError):
        kv.read_into("k", bytearray(8))
    with pytest.raises(kvpool.ClosedError):
        kv.match_prefix([b"k"])
    assert kv.put("k", b"v") == -600
    assert kv.get("k") == b""
    assert kv.is_exist("k") == -600
    assert kv.batch_is_exist(["a", "b"]) == [-600, -600]
    assert (
        kv.get_into("k", ctypes.addressof(buf), 8) == -600
    )  # registrations were dropped
    assert kv.register_buffer(ctypes.addressof(buf), 8) == -600
    assert kv.batch_get_into(["k"], [ctypes.addressof(buf)], [8]) == [-600]
    assert kv.remove("k") == -600
    assert kv.remove_all() == -600
    assert kv.health_check() == 1


def test_value_larger_than_the_pool(start_kvpoold):
    d = start_kvpoold(memory="64MiB")
    with kvpool.Client(d.url) as kv:
        big = bytearray(80 << 20)
        with pytest.raises((kvpool.TooLargeError, kvpool.PoolFullError)) as e:
            kv.write("huge", big)
        assert e.value.code == -200
        assert kv.put("huge", big) == -200


def test_bad_constructor_arguments(kvpoold):
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.Client("http://nowhere:1")
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.Client(kvpoold.url, timeout=0)
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.Client(kvpoold.url, timeout=float("nan"))
    with pytest.raises(kvpool.AuthError):
        kvpool.Client(kvpoold.url, namespace="no-such-namespace")


def test_token_refused(start_kvpoold):
    d = start_kvpoold(extra=["--token", "s3cret"])
    with pytest.raises(kvpool.AuthError) as e:
        kvpool.Client(d.url, token="wrong")
    assert isinstance(e.value, PermissionError) and e.value.code == -601
    with kvpool.Client(d.url, token="s3cret") as kv:
        kv.write("k", b"v")
        assert kv.read("k") == b"v"

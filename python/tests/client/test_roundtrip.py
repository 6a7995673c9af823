"""Round trips of every call of ``kvpool.Client`` against a real kvpoold: the Pythonic calls
(buffers in, exceptions out) and the Mooncake-compatible ones (status codes)."""

from __future__ import annotations

import ctypes

import kvpool
import pytest
from conftest import require_module


def numpy():
    """numpy, a test dependency (scripts/test installs it; missing under CI=true fails)."""
    return require_module("numpy", "pip install numpy")


@pytest.fixture
def kv(kvpoold):
    with kvpool.Client(kvpoold.url, timeout=10.0) as c:
        yield c


def test_context_manager_closes(kvpoold):
    with kvpool.Client(kvpoold.url) as c:
        assert not c.closed
        assert c.endpoint == kvpoold.url
    assert c.closed
    assert c.close() == 0  # twice is harmless


def test_same_host_path_is_used(kv):
    # The harness runs kvpoold on this host with its Unix socket in its data directory.
    assert kv.is_local()


def test_pythonic_round_trip_of_every_buffer_kind(kv):
    np = numpy()
    kv.write("b", b"bytes value")
    kv.write("ba", bytearray(b"bytearray value"))
    kv.write("mv", memoryview(b"memoryview value"))
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    kv.write("np", arr)
    ro = np.arange(10, dtype=np.int64)
    ro.flags.writeable = False
    kv.write("ro", ro)  # a read-only buffer is a fine source
    kv.write("empty", b"")

    assert kv.read("b") == b"bytes value"
    assert kv.read("ba") == b"bytearray value"
    assert kv.read("mv") == b"memoryview value"
    assert kv.read("empty") == b""
    out = np.empty_like(arr)
    assert kv.read_into("np", out) == arr.nbytes
    assert np.array_equal(out, arr)
    out = np.zeros(20, dtype=np.int64)  # larger than the value: its head is filled
    assert kv.read_into("ro", out) == 80
    assert np.array_equal(out[:10], ro) and not out[10:].any()
    ba = bytearray(32)
    assert kv.read_into(b"b", memoryview(ba)[4:]) == 11
    assert bytes(ba[4:15]) == b"bytes value"

    assert kv.exists("np") and not kv.exists("nope")
    assert kv.batch_exists(["b", "nope", "np"]) == [True, False, True]
    assert kv.delete("np") is True
    assert kv.delete("np") is False
    with pytest.raises(kvpool.NotFoundError) as e:
        kv.read("np")
    assert e.value.code == -704
    with pytest.raises(kvpool.NotFoundError):
        kv.read_into("np", bytearray(10))


def test_str_and_bytes_keys_are_the_same_object(kv):
    kv.write("ключ", b"v")
    assert kv.read("ключ".encode()) == b"v"


def test_batches(kv):
    np = numpy()
    keys = [f"blk-{i}" for i in range(64)]
    vals = [np.full(4096, i, dtype=np.uint8) for i in range(64)]
    kv.write_many(keys, vals)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in keys]
    assert kv.read_many_into(keys + [], outs) == [4096] * 64
    assert all((o == i).all() for i, o in enumerate(outs))
    got = kv.read_many_into(["blk-0", "missing"], [bytearray(4096), bytearray(4096)])
    assert got == [4096, None]


def test_match_prefix_counts_the_leading_run(kv):
    keys = kvpool.block_hashes(list(range(64)), 16, model="m")
    assert len(keys) == 4
    assert kv.match_prefix(keys) == 0
    kv.write_many(keys[:2], [b"a", b"b"])
    kv.write(keys[3], b"d")  # after a gap: not part of the run
    assert kv.match_prefix(keys) == 2
    assert kv.match_prefix([]) == 0


def test_mooncake_calls_and_their_codes(kv):
    np = numpy()
    # put / get / is_exist / batch_is_exist / remove
    assert kv.put("k", b"hello") == 0
    assert kv.put("k2", np.arange(4, dtype=np.int32)) == 0
    assert kv.get("k") == b"hello"
    assert kv.get("missing") == b""
    assert kv.is_exist("k") == 1 and kv.is_exist("missing") == 0
    assert kv.batch_is_exist(["k", "missing", "k2"]) == [1, 0, 1]
    assert kv.remove("k2") == 0
    assert kv.remove("k2") == -704
    assert kv.health_check() == 0

    # register_buffer / put_from / get_into / unregister_buffer
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    assert kv.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert kv.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert kv.put_from("z", src.ctypes.data, src.nbytes) == 0
    assert kv.get_into("z", dst.ctypes.data, dst.nbytes) == src.nbytes
    assert np.array_equal(src, dst)
    assert kv.get_into("missing", dst.ctypes.data, dst.nbytes) == -704

    # batch_put_from / batch_get_into, inside one registration
    half = 1 << 15
    ptrs = [src.ctypes.data, src.ctypes.data + half]
    assert kv.batch_put_from(["h0", "h1"], ptrs, [half, half]) == [0, 0]
    dst[:] = 0
    dptrs = [dst.ctypes.data + half, dst.ctypes.data]  # swapped halves
    assert kv.batch_get_into(["h0", "h1"], dptrs, [half, half]) == [half, half]
    assert np.array_equal(dst[half:], src[:half]) and np.array_equal(
        dst[:half], src[half:]
    )
    got = kv.batch_get_into(["h0", "missing"], dptrs, [half, half])
    assert got == [half, -704]
    # Two destinations that overlap are both refused; the others are served.
    overlapping = [dst.ctypes.data, dst.ctypes.data + 1, dst.ctypes.data + half + 1]
    got = kv.batch_get_into(["h0", "h1", "h1"], overlapping, [half, 8, half - 1])
    assert got == [-600, -600, -10]

    assert kv.unregister_buffer(src.ctypes.data) == 0
    assert kv.unregister_buffer(src.ctypes.data) == -600
    assert kv.put_from("z", src.ctypes.data, src.nbytes) == -600
    assert kv.unregister_buffer(dst.ctypes.data) == 0


def test_remove_all_removes_every_object_and_counts_them(kv):
    for i in range(20):
        assert kv.put(f"x{i}", b"1" * (i + 1)) == 0
    assert kv.remove_all() == 20
    assert kv.batch_is_exist([f"x{i}" for i in range(20)]) == [0] * 20
    assert kv.remove_all() == 0
    kv.write("y", b"2")
    assert kv.clear() == 1


def test_torch_style_pointer_and_nbytes(kv):
    """A tensor without the buffer protocol goes in by data_ptr()/nbytes: here a ctypes array
    stands in for it."""
    n = 1 << 12
    src = (ctypes.c_uint8 * n)(*([7] * n))
    dst = (ctypes.c_uint8 * n)()
    for b in (src, dst):
        assert kv.register_buffer(ctypes.addressof(b), n) == 0
    assert kv.put_from("t", ctypes.addressof(src), n) == 0
    assert kv.get_into("t", ctypes.addressof(dst), n) == n
    assert bytes(dst) == bytes(src)


def test_same_host_off_goes_over_tcp(kvpoold):
    np = numpy()
    with kvpool.Client(kvpoold.url, same_host=False) as kv:
        assert not kv.is_local()
        src = np.arange(1 << 20, dtype=np.uint8)
        kv.write("tcp", src)
        dst = np.zeros_like(src)
        assert kv.read_into("tcp", dst) == src.nbytes
        assert np.array_equal(src, dst)

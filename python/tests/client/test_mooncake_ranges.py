"""Mooncake Store's `get_size` and `get_into_ranges`, with Mooncake's shapes and return codes,
on the same-host path and over the socket."""

from __future__ import annotations

import ctypes

import kvpool
import pytest


@pytest.mark.parametrize("same_host", [True, False])
def test_get_size_and_the_documented_get_into_ranges_example(start_kvpoold, same_host):
    d = start_kvpoold(memory="64MiB")
    key1 = bytes(range(64))
    key2 = bytes(range(100, 140))
    with kvpool.Client(d.url, same_host=same_host) as kv:
        assert kv.is_local() == same_host
        assert kv.put("key1", key1) == 0
        assert kv.put("key2", key2) == 0
        assert kv.get_size("key1") == 64
        assert kv.get_size("key2") == 40
        assert kv.get_size("absent") == -704
        assert kv.get_size(b"") == -400

        buf0 = (ctypes.c_ubyte * 32)()
        buf1 = (ctypes.c_ubyte * 32)()
        p0, p1 = ctypes.addressof(buf0), ctypes.addressof(buf1)
        assert kv.register_buffer(p0, 32) == 0
        assert kv.register_buffer(p1, 32) == 0
        results = kv.get_into_ranges(
            [p0, p1],
            [["key1", "key2"], ["key2", "key1"]],
            [[[0, 20], [8]], [[4], [16]]],
            [[[1, 30], [2]], [[0], [10]]],
            [[[4, 3], [5]], [[6], [4]]],
        )
        assert results == [[[4, 3], [5]], [[6], [4]]]
        b0, b1 = bytes(buf0), bytes(buf1)
        assert b0[0:4] == key1[1:5] and b0[20:23] == key1[30:33]
        assert b0[8:13] == key2[2:7]
        assert b1[4:10] == key2[0:6] and b1[16:20] == key1[10:14]
        # Bytes no fragment names are left alone.
        assert b0[4:8] == bytes(4) and b1[0:4] == bytes(4)


def test_get_into_ranges_refuses_each_bad_fragment_on_its_own(start_kvpoold):
    d = start_kvpoold(memory="64MiB")
    with kvpool.Client(d.url) as kv:
        assert kv.put("v", bytes(range(16))) == 0
        buf = (ctypes.c_ubyte * 16)()
        p = ctypes.addressof(buf)
        assert kv.register_buffer(p, 16) == 0
        got = kv.get_into_ranges(
            [p],
            [["v", "absent", "v", "v", b""]],
            [[[0, 12], [0], [14], [0], [0]]],
            # a good fragment then one past the value's end; a miss; one past the buffer's
            # end; lists of different lengths; a bad key
            [[[0, 10], [0], [0], [0, 1], [0]]],
            [[[4, 8], [4], [4], [1], [1]]],
        )
        assert got == [[[4, -600], [-704], [-600], [-600], [-400]]]
        assert bytes(buf)[0:4] == bytes(range(4))
        # A top-level shape mismatch: every fragment refused, nothing read.
        assert kv.get_into_ranges([p, p], [["v"]], [[[0]]], [[[0]]], [[[4]]]) == [
            [[-600]]
        ]
        # An unregistered destination.
        other = (ctypes.c_ubyte * 8)()
        assert kv.get_into_ranges(
            [ctypes.addressof(other)], [["v"]], [[[0]]], [[[0]]], [[[4]]]
        ) == [[[-600]]]
        assert bytes(other) == bytes(8)

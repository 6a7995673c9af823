"""``fabric://`` from Python: a node serving its segments over libfabric's ``tcp`` provider,
and a client that reads values one-sidedly over it, into registered numpy buffers (whole and
scattered) and as bytes; what it reads is what a plain TCP client wrote, and a value replaced
between two reads is read new."""

from __future__ import annotations

import os
import signal
import time

import kvpool
import pytest
from conftest import require_module


def test_gets_over_the_fabric_fill_registered_buffers(start_kvpoold):
    np = require_module("numpy", "pip install numpy")
    d = start_kvpoold(memory="256MiB", extra=["--fabric", "tcp"])
    url = f"fabric://{d.tcp}"
    values = {f"block-{i}": os.urandom((1 << 20) + i * 4096) for i in range(4)}
    with kvpool.Client(d.url, same_host=False) as plain:
        for k, v in values.items():
            plain.write(k, v)
    with kvpool.Client(url, same_host=False) as kv:
        assert not kv.is_local()
        for k, v in values.items():
            assert kv.read(k) == v
        size = 2 << 20
        bufs = np.zeros((4, size), dtype=np.uint8)
        assert kv.register_buffer(bufs.ctypes.data, bufs.nbytes) == 0
        keys = ["block-0", "absent", "block-3", "block-1"]
        got = kv.batch_get_into(
            keys, [bufs[i].ctypes.data for i in range(4)], [size] * 4
        )
        assert got == [
            len(values["block-0"]),
            -704,
            len(values["block-3"]),
            len(values["block-1"]),
        ]
        for key, slot in (("block-0", 0), ("block-3", 2), ("block-1", 3)):
            v = values[key]
            assert bufs[slot, : len(v)].tobytes() == v, key
        # Scattered into pages, as a paged KV cache loads a block.
        page = 256 << 10
        pages = np.zeros((4, page), dtype=np.uint8)
        assert kv.register_buffer(pages.ctypes.data, pages.nbytes) == 0
        whole = os.urandom(4 * page)
        kv.write("paged", whole)
        got = kv.batch_get_scatter(
            ["paged"], [[(pages[i].ctypes.data, page) for i in range(4)]]
        )
        assert got == [4 * page]
        assert pages.tobytes() == whole
        # Replaced between reads: the new value, never the old bytes.
        for i in range(10):
            v = os.urandom(64 << 10)
            kv.write("changing", v)
            assert kv.read("changing") == v, i
        assert kv.unregister_buffer(bufs.ctypes.data) == 0
    # Loading libfabric kept Python's handlers: Ctrl-C is still a KeyboardInterrupt (a provider
    # library's own handler would end the interpreter with exit status 1 here).
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

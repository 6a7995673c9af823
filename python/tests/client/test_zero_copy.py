"""Zero-copy gets of 256 MiB into numpy arrays, over the same-host path."""

from __future__ import annotations

import kvpool
from conftest import require_module

SIZE = 256 << 20


def test_get_into_a_256_mib_numpy_array(start_kvpoold):
    np = require_module("numpy", "pip install numpy")
    d = start_kvpoold(memory="1GiB")
    with kvpool.Client(d.url, timeout=60.0) as kv:
        assert kv.is_local()
        src = (np.arange(SIZE, dtype=np.uint32) % 251).astype(np.uint8)
        kv.write("weights", src)

        dst = np.empty(SIZE, dtype=np.uint8)
        assert kv.read_into("weights", dst) == SIZE
        assert np.array_equal(src, dst)

        # The Mooncake form, into a registered 2-D array.
        dst2 = np.zeros((1024, SIZE // 1024), dtype=np.uint8)
        assert kv.register_buffer(dst2.ctypes.data, dst2.nbytes) == 0
        assert kv.get_into("weights", dst2.ctypes.data, dst2.nbytes) == SIZE
        assert np.array_equal(src, dst2.reshape(-1))
        assert kv.unregister_buffer(dst2.ctypes.data) == 0


def test_batch_get_scatter_fills_pieces_in_order_on_both_paths(start_kvpoold):
    """An object holding every layer of a KV block goes into per-layer pages: the same host
    copies straight into the pieces, another host's path fetches then scatters; bad pieces are
    refused per key."""
    np = require_module("numpy", "pip install numpy")
    d = start_kvpoold(memory="256MiB")
    page, layers = 64 << 10, 8
    values = {
        f"block-{i}": np.random.default_rng(i).integers(0, 256, page * layers, np.uint8)
        for i in range(3)
    }
    for same_host in (True, False):
        with kvpool.Client(d.url, same_host=same_host) as kv:
            assert kv.is_local() == same_host
            for k, v in values.items():
                kv.write(k, v)
            # Pages laid out per layer, blocks interleaved, as in a paged cache.
            cache = np.zeros((layers, 4, page), dtype=np.uint8)
            assert kv.register_buffer(cache.ctypes.data, cache.nbytes) == 0

            def pieces(block: int, cache=cache) -> list[tuple[int, int]]:
                return [(cache[lay, block].ctypes.data, page) for lay in range(layers)]

            keys = ["block-0", "block-2", "absent", "block-1"]
            got = kv.batch_get_scatter(
                keys, [pieces(0), pieces(1), pieces(2), pieces(3)]
            )
            assert got == [page * layers, page * layers, -704, page * layers]
            for key, slot in (("block-0", 0), ("block-2", 1), ("block-1", 3)):
                assert np.array_equal(cache[:, slot].reshape(-1), values[key]), key
            assert not cache[:, 2].any(), "a miss writes nothing"
            # Refused per key: a piece outside any registration, overlapping pieces, and
            # pieces that do not add up to the value.
            outside = np.zeros(page, dtype=np.uint8)
            bad = [
                pieces(0)[:-1] + [(outside.ctypes.data, page)],
                pieces(1)[:1] + pieces(1)[:1] + pieces(1)[2:],
                pieces(2)[:-1],
                pieces(3),
            ]
            got = kv.batch_get_scatter(
                ["block-0", "block-1", "block-2", "block-1"], bad
            )
            assert got[:3] == [-600, -600, -600]
            assert got[3] == page * layers
            assert kv.unregister_buffer(cache.ctypes.data) == 0

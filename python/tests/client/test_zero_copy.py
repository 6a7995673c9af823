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

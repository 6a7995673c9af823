"""The same-host client's memory of where it found keys (``local_index``): a repeated batched
get reads them without a lookup, yet always returns the key's current value: after another
client overwrites or removes it, and with the index turned off."""

from __future__ import annotations

import kvpool
from conftest import require_module

N = 40_000


def _values(np, seed: int, count: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, N, dtype=np.uint8) for _ in range(count)]


def _batch_get(np, kv, keys):
    dsts = [np.zeros(N, dtype=np.uint8) for _ in keys]
    for d in dsts:
        assert kv.register_buffer(d.ctypes.data, d.nbytes) == 0
    got = kv.batch_get_into(keys, [d.ctypes.data for d in dsts], [N] * len(keys))
    for d in dsts:
        assert kv.unregister_buffer(d.ctypes.data) == 0
    return got, dsts


def test_a_remembered_key_reads_its_current_value(start_kvpoold):
    np = require_module("numpy", "pip install numpy")
    d = start_kvpoold(memory="64MiB")
    keys = [f"seen-{i}" for i in range(6)]
    with (
        kvpool.Client(d.url) as a,
        kvpool.Client(d.url) as b,
        kvpool.Client(d.url, local_index=0) as off,
    ):
        assert a.is_local() and off.is_local()
        first = _values(np, 1, len(keys))
        for k, v in zip(keys, first):
            assert a.put(k, v) == 0
        for _ in range(3):  # the first call looks up, the others read from the index
            got, dsts = _batch_get(np, a, keys)
            assert got == [N] * len(keys)
            assert all(np.array_equal(x, y) for x, y in zip(dsts, first))

        second = _values(np, 2, len(keys))
        for k, v in zip(keys, second):
            assert b.put(k, v) == 0
        for client in (a, off):
            got, dsts = _batch_get(np, client, keys)
            assert got == [N] * len(keys)
            assert all(np.array_equal(x, y) for x, y in zip(dsts, second))

        assert b.remove(keys[2]) == 0
        got, dsts = _batch_get(np, a, keys)
        assert got[2] < 0 and [g for i, g in enumerate(got) if i != 2] == [N] * 5
        assert a.get(keys[2]) == b""
        assert a.get(keys[3]) == second[3].tobytes()


def test_a_negative_local_index_is_refused():
    try:
        kvpool.Client("tcp://127.0.0.1:1", local_index=-1)
    except (OverflowError, TypeError, ValueError):
        return
    raise AssertionError("a negative local_index was accepted")

"""The disk tier through the Python client: blocks DRAM evicted are found again by
``match_prefix`` and read back by ``get`` and ``batch_get_into``, and ``stats()`` shows both tiers."""

from __future__ import annotations

import time

import kvpool

LEN = 1 << 20


def value(i: int) -> bytes:
    return bytes((j * 7 + i * 131) & 0xFF for j in range(256)) * (LEN // 256)


def test_evicted_blocks_come_back_and_stats_show_both_tiers(start_kvpoold, tmp_path):
    d = start_kvpoold(
        memory="16MiB",
        extra=[
            "--disk-path",
            str(tmp_path / "disk"),
            "--disk-capacity",
            "128MiB",
            "--disk-region-size",
            "4MiB",
            "--disk-admit",
            "all",
        ],
    )
    keys = [f"py-disk-{i}" for i in range(40)]
    with kvpool.Client(d.url, timeout=20.0) as kv:
        for i, k in enumerate(keys):
            kv.write(k, value(i))
        deadline = time.monotonic() + 30
        while True:
            s = kv.stats()
            disk = s["disk"]
            if s["evictions"] > 0 and disk["demoted"] == s["evictions"]:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        assert disk["objects"] >= len(keys) - 16
        assert disk["capacity"] == 128 << 20
        assert kv.match_prefix(keys) == len(keys)
        for i, k in enumerate(keys):
            assert kv.read(k) == value(i), k
        after = kv.stats()["disk"]
        assert after["promoted"] >= len(keys) - 16
        assert after["bytes_read"] >= after["promoted"] * LEN
        assert after["checksum_failures"] == 0


def test_stats_without_a_disk_tier(kvpoold):
    with kvpool.Client(kvpoold.url) as kv:
        s = kv.stats()
        assert s["disk"] is None
        assert s["objects"] == 0
        assert {"hits", "misses", "evictions", "segments", "namespaces"} <= s.keys()

"""kvpool.block_hashes computes docs/HASHING.md's keys: every test vector of its table."""

from __future__ import annotations

import re

import kvpool
import pytest
from conftest import REPO

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Row number -> (token count, seed fields that differ from the table's default seed).
ROWS = {
    0: (16, {}),
    1: (16, {"salt": ""}),
    2: (16, {"salt": "user-42"}),
    3: (16, {"tenant": "acme"}),
    4: (40, {}),
    5: (96, {"block_tokens": 32}),
    6: (128, {"block_tokens": 64}),
    7: (256, {"block_tokens": 256}),
    8: (32, {"tp_rank": 1, "tp_size": 2}),
    9: (16, {"pp_stage": 1, "layer_start": 16, "layer_end": 32}),
    10: (16, {"dtype": "fp8_e4m3"}),
    11: (15, {}),
    12: (1600, {}),
}


def vectors():
    """(row, keys, first hex, last hex) from the table in docs/HASHING.md."""
    text = (REPO / "docs" / "HASHING.md").read_text()
    out = []
    for line in text.splitlines():
        m = re.match(
            r"\|\s*(\d+)\s*\|[^|]*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)\|(.*)\|",
            line,
        )
        if m:
            row, _tokens, _bt, nkeys = (int(m.group(i)) for i in range(1, 5))
            first = re.search(r"`([0-9a-f]{32})`", m.group(5))
            last = re.search(r"`([0-9a-f]{32})`", m.group(6))
            out.append((row, nkeys, first and first.group(1), last and last.group(1)))
    return out


def tokens(n):
    return [(j * 7919 + 13) % 128256 for j in range(n)]


@pytest.mark.parametrize("row,nkeys,first,last", vectors())
def test_vector(row, nkeys, first, last):
    n, fields = ROWS[row]
    seed = {
        "model": MODEL,
        "dtype": "bf16",
        "tp_rank": 0,
        "tp_size": 1,
        "pp_stage": 0,
        "layer_start": 0,
        "layer_end": 32,
    }
    seed.update(fields)
    bt = seed.pop("block_tokens", 16)
    keys = kvpool.block_hashes(tokens(n), bt, **seed)
    assert len(keys) == nkeys
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    if nkeys:
        assert keys[0].hex() == first
        assert keys[-1].hex() == last


def test_every_row_of_the_table_is_checked():
    assert sorted(v[0] for v in vectors()) == sorted(ROWS)


def test_bad_arguments():
    with pytest.raises(ValueError):
        kvpool.block_hashes([1, 2, 3], 0)
    with pytest.raises(OverflowError):
        kvpool.block_hashes([-1] * 16, 16)
    assert kvpool.block_hashes([], 16) == []


def test_readme_example_gives_the_same_keys_from_the_cli_and_python():
    """README's `prefix hash` line, run through the CLI and through `kvpool.block_hashes`
    with the same arguments (every unstated seed field at its default on both sides)."""
    import os
    import shlex
    import subprocess

    from conftest import require

    cli = os.environ.get("KVPOOL_CLI", str(REPO / "target" / "debug" / "kvpool"))
    require(os.path.exists(cli), f"the kvpool CLI ({cli})", "cargo build -p kvpool-cli")
    line = next(
        ln
        for ln in (REPO / "README.md").read_text().splitlines()
        if " prefix hash " in ln
    )
    args = shlex.split(line.split("#", 1)[0])[1:]  # drop `$K`
    assert args[:2] == ["prefix", "hash"], line
    opts, tokens = {}, []
    it = iter(args[2:])
    for a in it:
        if a.startswith("--"):
            opts[a[2:].replace("-", "_")] = next(it)
        else:
            tokens.append(int(a))
    out = subprocess.run(
        [cli, *args], check=True, capture_output=True, text=True
    ).stdout.split()
    block_tokens = int(opts.pop("block_tokens", 16))
    keys = kvpool.block_hashes(tokens, block_tokens, **opts)
    assert out and out == [k.hex() for k in keys]

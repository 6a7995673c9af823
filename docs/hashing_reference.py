#!/usr/bin/env python3
"""Reference implementation of kvpool's prefix hashing (docs/HASHING.md), using the `xxhash`
package (pip install xxhash). Prints the keys of a token list, or checks a vector file:

    python3 docs/hashing_reference.py --check vectors.json

where vectors.json is a list of {"seed": {...}, "tokens": [...], "keys": ["hex", ...]}.
"""
import json
import struct
import sys

import xxhash

SEED_TAG = b"kvpool-prefix-v1"


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def encode_seed(tenant="", model="", dtype="", tp_rank=0, tp_size=1, pp_stage=0,
                layer_start=0, layer_end=0, block_tokens=16, salt=None):
    b = SEED_TAG + _str(tenant) + _str(model) + _str(dtype)
    b += struct.pack("<6I", tp_rank, tp_size, pp_stage, layer_start, layer_end, block_tokens)
    b += b"\x00" if salt is None else b"\x01" + _str(salt)
    return b


def seed(**fields):
    return xxhash.xxh3_128_intdigest(encode_seed(**fields))


def chain(prev, block):
    data = prev.to_bytes(16, "little") + struct.pack("<I", len(block))
    data += struct.pack("<%dI" % len(block), *block)
    return xxhash.xxh3_128_intdigest(data)


def block_keys(seed_fields, tokens):
    """Keys (16 bytes each, hex) of every full block of tokens."""
    n = seed_fields.get("block_tokens", 16)
    h = seed(**seed_fields)
    keys = []
    for i in range(0, len(tokens) - len(tokens) % n, n):
        h = chain(h, tokens[i:i + n])
        keys.append(h.to_bytes(16, "little").hex())
    return keys


def main(argv):
    if len(argv) == 3 and argv[1] == "--check":
        vectors = json.load(open(argv[2]))
        bad = 0
        for i, v in enumerate(vectors):
            got = block_keys(v["seed"], v["tokens"])
            if got != v["keys"]:
                bad += 1
                print("vector %d differs: %s != %s" % (i, got, v["keys"]))
        print("%d vectors, %d differ" % (len(vectors), bad))
        return 1 if bad else 0
    fields = json.loads(argv[1]) if len(argv) > 1 else {}
    tokens = [int(t) for t in sys.stdin.read().split()]
    for k in block_keys(fields, tokens):
        print(k)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

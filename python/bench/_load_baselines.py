"""The references of ``connector_load.py``: a memcpy and a raw TCP stream of the same bytes,
and models of the client's own work on a value (hashing it as it is copied or received)."""

from __future__ import annotations

import ctypes
import socket
import subprocess
import sys

import torch
from _load_common import MIB, best_of


class Memcpy:
    """One thread, libc memcpy between two preallocated, pre-touched buffers."""

    def __init__(self, nbytes: int):
        self.n = nbytes
        self.src = torch.full((nbytes,), 3, dtype=torch.uint8)
        self.dst = torch.full((nbytes,), 0, dtype=torch.uint8)

    def run(self) -> None:
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.n)

    def run_pieces(self, piece: int = 4 * MIB) -> None:
        """The same bytes in ``piece``-sized memmoves (a context row, not the goal's
        baseline): one copy of 512 MiB can use glibc's non-temporal stores, copies of a few
        MiB cannot."""
        src, dst = self.src.data_ptr(), self.dst.data_ptr()
        for o in range(0, self.n, piece):
            ctypes.memmove(dst + o, src + o, min(piece, self.n - o))


SERVER = r"""
import socket, sys
n = int(sys.argv[1])
buf = bytearray(b"\x07") * n          # written, so its pages are real memory
view = memoryview(buf)
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(1)
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    req = c.recv(8)
    if len(req) < 8:
        break
    c.sendall(view[: int.from_bytes(req, "little")])
"""


class RawTcp:
    """A raw TCP stream over loopback: a server process ``sendall``s ``nbytes`` of one
    preallocated buffer per 8-byte request; this process ``recv_into`` a preallocated buffer
    (no framing, no copies beyond the kernel's)."""

    def __init__(self, nbytes: int):
        self.n = nbytes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(nbytes)], stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = torch.full((nbytes,), 0, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy()).cast("B")

    def run(self) -> None:
        self.sock.sendall(self.n.to_bytes(8, "little"))
        got, view, n = 0, self.view, self.n
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError("the raw TCP server closed")
            got += r

    def run_hashed(self) -> None:
        """The stream received in reads of at most 64 KiB, each hashed with xxh3-64 as it
        arrives (the shape of the client's verified TCP receive)."""
        import xxhash

        h = xxhash.xxh3_64()
        self.sock.sendall(self.n.to_bytes(8, "little"))
        got, view, n = 0, self.view, self.n
        while got < n:
            r = self.sock.recv_into(view[got:], min(64 << 10, n - got))
            if r == 0:
                raise ConnectionError("the raw TCP server closed")
            h.update(view[got : got + r])
            got += r

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def verify_models(nbytes: int, memcpy: Memcpy) -> dict:
    """What kvpool's client does to a value besides moving it: it hashes every 64 KiB chunk
    with xxh3-64 right after copying it (docs/ARCHITECTURE.md), and checks the sum. Timed with
    the Python ``xxhash`` package (the same C xxh3), one thread: the hash alone over a chunk
    that stays in cache, a Python loop of one memmove per 64 KiB chunk, and of memmove + hash per
    64 KiB chunk (the shape of the client's verified same-host copy, plus about 1 us of Python
    per call), next to one memcpy of the whole."""
    try:
        import xxhash
    except ImportError:
        return {"skipped": "the xxhash package is not installed"}
    chunk = 64 << 10
    n = nbytes // chunk
    src, dst = memcpy.src.data_ptr(), memcpy.dst.data_ptr()
    mv = memoryview(memcpy.dst.numpy()).cast("B")

    def hash_only() -> None:
        h = xxhash.xxh3_64()
        one = mv[:chunk]
        for _ in range(n):
            h.update(one)

    def copy_chunks() -> None:
        for i in range(n):
            o = i * chunk
            ctypes.memmove(dst + o, src + o, chunk)

    def copy_then_hash() -> None:
        h = xxhash.xxh3_64()
        for i in range(n):
            o = i * chunk
            ctypes.memmove(dst + o, src + o, chunk)
            h.update(mv[o : o + chunk])

    return {
        "xxh3_64_in_cache_ms": best_of(hash_only, 3) * 1e3,
        "memmove_per_64KiB_ms": best_of(copy_chunks, 3) * 1e3,
        "memmove_then_xxh3_per_64KiB_ms": best_of(copy_then_hash, 3) * 1e3,
        "memcpy_ms": best_of(memcpy.run, 3) * 1e3,
    }

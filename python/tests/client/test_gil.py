"""A call that waits on the network releases the GIL: other Python threads run meanwhile. The
node here is a socket that accepts and never answers, so the handshake waits for the timeout."""

from __future__ import annotations

import socket
import threading
import time

import kvpool

TIMEOUT_S = 2.0


def test_a_blocked_call_releases_the_gil():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    result: list[BaseException] = []

    def connect() -> None:
        try:
            kvpool.Client(f"tcp://127.0.0.1:{port}", timeout=TIMEOUT_S)
        except kvpool.Error as e:
            result.append(e)

    t = threading.Thread(target=connect, daemon=True)
    start = time.monotonic()
    t.start()
    spins = 0
    while t.is_alive() and time.monotonic() - start < 10 * TIMEOUT_S:
        spins += (
            1  # pure Python: runs only while the other thread does not hold the GIL
        )
    t.join(1)
    silent.close()
    assert not t.is_alive(), "the call did not return within its timeout"
    assert len(result) == 1 and isinstance(result[0], kvpool.ConnectionError), result
    # Two seconds of a free GIL are millions of iterations; a held GIL would allow only the
    # interpreter's switch-interval slices (a few hundred).
    assert spins > 100_000, spins

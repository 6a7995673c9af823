"""One client shared by 8 threads, 1 000 operations each: no deadlock (bounded by a timeout),
no lost or mixed-up value. Every call releases the GIL, so the threads overlap."""

from __future__ import annotations

import threading

import kvpool

THREADS = 8
OPS = 1000
DEADLINE_S = 120


def test_eight_threads_share_one_client(kvpoold):
    kv = kvpool.Client(kvpoold.url, timeout=10.0)
    errors: list[Exception] = []
    done = []

    def worker(t: int) -> None:
        try:
            buf = bytearray(256)
            for i in range(OPS):
                key = (
                    f"t{t}-{(i // 5) % 50}"  # written by ops 0 and 1 of its group of 5
                )
                val = f"{t}:{i}".encode().ljust(64, b".")
                op = i % 5
                if op < 2:
                    kv.write(key, val)
                elif op == 2:
                    n = kv.read_into(key, buf)
                    assert buf[:n].startswith(f"{t}:".encode()), bytes(buf[:n])
                elif op == 3:
                    assert kv.is_exist(key) == 1
                else:
                    assert kv.get(key).startswith(f"{t}:".encode())
            done.append(t)
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [
        threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE_S)
    assert not [th for th in threads if th.is_alive()], "a thread is stuck: deadlock?"
    assert not errors, errors[:3]
    assert sorted(done) == list(range(THREADS))
    kv.close()

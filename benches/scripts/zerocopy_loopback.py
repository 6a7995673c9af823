#!/usr/bin/env python3
"""Whether the kernel keeps a MSG_ZEROCOPY send zero-copy on this path.

Sends 8 MiB in 1 MiB MSG_ZEROCOPY sends to a reader on the same host and reads the socket's
error queue: each completion notification says whether the kernel sent the caller's pages
(code 0) or copied them after all (code 1, SO_EE_CODE_ZEROCOPY_COPIED). Over loopback Linux
copies them when it delivers the packets to the local socket, so a zero-copy send of kvpoold's
replies would save nothing there (docs/BENCHMARKS.md, "What bounds it").

    python3 benches/scripts/zerocopy_loopback.py [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import threading
import time

SO_ZEROCOPY = 60
MSG_ZEROCOPY = 0x4000000
MSG_ERRQUEUE = 0x2000
SO_EE_ORIGIN_ZEROCOPY = 5
SO_EE_CODE_ZEROCOPY_COPIED = 1
SENDS = 8
PIECE = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to listen on and send to"
    )
    args = ap.parse_args()
    srv = socket.socket()
    srv.bind((args.host, 0))
    srv.listen(1)
    received = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while chunk := conn.recv(PIECE):
                received[0] += len(chunk)

    reader = threading.Thread(target=sink)
    reader.start()
    s = socket.create_connection(srv.getsockname())
    s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    buf = bytearray(b"x" * PIECE)
    for _ in range(SENDS):
        s.sendall(buf, MSG_ZEROCOPY)
    sends_done, copied, zero_copy = 0, 0, 0
    deadline = time.monotonic() + 5.0
    while sends_done < SENDS and time.monotonic() < deadline:
        try:
            _, ancillary, _, _ = s.recvmsg(0, 1024, MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        for _, _, data in ancillary:
            # struct sock_extended_err: errno, origin, type, code, pad, info, data
            _, origin, _, code, _, first, last = struct.unpack("IBBBBII", data[:16])
            if origin != SO_EE_ORIGIN_ZEROCOPY:
                continue
            n = last - first + 1
            sends_done += n
            if code == SO_EE_CODE_ZEROCOPY_COPIED:
                copied += n
            else:
                zero_copy += n
    s.close()
    reader.join()
    print(
        json.dumps(
            {
                "host": args.host,
                "sends": SENDS,
                "bytes_received": received[0],
                "notified": sends_done,
                "copied_by_the_kernel": copied,
                "sent_zero_copy": zero_copy,
            }
        )
    )


if __name__ == "__main__":
    main()

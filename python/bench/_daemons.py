"""The servers the Python benchmarks start and stop: kvpoold (data directory under /dev/shm,
every listener on a free loopback port, addresses read back from its ready line) and
redis-server (no persistence). Each benchmark runs as a script, so this module is imported from
the script's own directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kvpoold:
    """A kvpoold child process; ``addrs`` holds its ready line's addresses (``tcp``,
    ``metrics``, ``unix``, ...)."""

    def __init__(
        self,
        binary: str,
        memory: str,
        extra: list[str] | None = None,
        prefix: str = "kvpool-bench-",
    ):
        self.dir = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
        cmd = [binary, "--data-dir", self.dir, "--memory", memory]
        cmd += ["--tcp", "127.0.0.1:0", "--quic", "127.0.0.1:0"]
        cmd += ["--metrics", "127.0.0.1:0", *(extra or [])]
        env = dict(os.environ, KVPOOL_LOG="warn")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "kvpoold ready" not in line:
            self.proc.kill()
            shutil.rmtree(self.dir, ignore_errors=True)
            sys.exit(f"kvpoold did not start: {line!r}")
        self.addrs = dict(w.split("=", 1) for w in line.split() if "=" in w)

    @property
    def tcp(self) -> str:
        """``host:port`` of the native TCP listener."""
        return self.addrs["tcp"]

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s), then the data directory goes."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_redis(binary: str) -> tuple[subprocess.Popen, int]:
    """redis-server on a free loopback port, without persistence; (process, port)."""
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, port
        except OSError:
            time.sleep(0.05)
    p.kill()
    sys.exit("redis-server did not start")

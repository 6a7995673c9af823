"""The kvpoold ``weights_bench.py`` measures against: a process of its own on a data directory
under /dev/shm, and where its binary is found."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


class Daemon:
    """A kvpoold of its own on a data directory under /dev/shm, stopped by :meth:`stop`."""

    def __init__(self, binary: Path, memory: int, tag: str):
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvpool-wbench-{tag}-", dir=shm_dir()))
        mib = -(-memory // (1 << 20))
        cmd = [str(binary), "--data-dir", str(self.dir), "--memory", f"{mib}MiB"]
        cmd += ["--tcp", "127.0.0.1:0", "--quic", "", "--metrics", ""]
        env = dict(os.environ, KVPOOL_LOG="warn")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
        line: list[str] = []
        ready = threading.Event()

        def read(proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            line.append(proc.stdout.readline().decode(errors="replace"))
            ready.set()
            for _ in proc.stdout:
                pass

        threading.Thread(target=read, args=(self.proc,), daemon=True).start()
        ready.wait(30)
        if not line or "kvpoold ready" not in line[0]:
            self.stop()
            raise RuntimeError(f"kvpoold did not become ready: {line!r}")
        addrs = dict(w.split("=", 1) for w in line[0].split() if "=" in w)
        self.url = f"tcp://{addrs['tcp']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def shm_dir() -> Optional[str]:  # noqa: UP045
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def find_kvpoold(flag: Optional[str]) -> Path:  # noqa: UP045
    """``--kvpoold``, else target/release/kvpoold, else ``$KVPOOLD``."""
    release = REPO / "target" / "release" / "kvpoold"
    if flag:
        p = Path(flag)
    elif release.exists() or not os.environ.get("KVPOOLD"):
        p = release
    else:
        p = Path(os.environ["KVPOOLD"])
    if not p.exists():
        raise SystemExit(f"{p} does not exist: cargo build --release -p kvpool-server")
    return p

"""The pytest harness every Python test shares: real ``kvpoold`` processes on free loopback
ports, each with its own data directory, stopped (SIGTERM, then SIGKILL) when the test ends.

It mirrors the Rust harness in ``tests/src/lib.rs``: the daemon is the workspace's own build
(``target/debug/kvpoold``, or ``$KVPOOLD``), started with explicit ports and read back from the
ready line it prints. A tool a test drives that is missing fails under ``CI=true`` (``.ci/run``
installs every one) and is reported as skipped elsewhere, never passed silently.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# vLLM picks its platform once per process, when first imported (by its own tests or through
# another engine's modules): on a GPU-less machine it must be told the CPU before that, or its
# config objects fail with "Failed to infer device type".
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def in_ci() -> bool:
    """Whether this run is CI's (the ``CI`` variable that CI services and ``.ci/run`` set)."""
    v = os.environ.get("CI", "")
    return v not in ("", "0", "false")


def require(present: bool, tool: str, install: str) -> None:
    """Fails the test (in CI) or skips it (elsewhere) when ``tool`` is missing."""
    if present:
        return
    why = f"{tool} is not installed ({install})"
    if in_ci():
        pytest.fail(
            f"{why}; CI installs it, so its absence is a failure", pytrace=False
        )
    pytest.skip(why)


def require_module(name: str, install: str):
    """Imports and returns module ``name``, or fails/skips like :func:`require`."""
    try:
        return __import__(name)
    except ImportError:
        require(False, f"python module {name}", install)


def kvpoold_bin() -> Path:
    """The daemon under test: ``$KVPOOLD`` or the workspace's debug build."""
    p = Path(os.environ.get("KVPOOLD", REPO / "target" / "debug" / "kvpoold"))
    if not p.exists():
        pytest.fail(
            f"{p} does not exist: build it first (cargo build -p kvpool-server)",
            pytrace=False,
        )
    return p


class Kvpoold:
    """A running ``kvpoold`` child process."""

    def __init__(
        self,
        memory: str = "256MiB",
        extra: list[str] | None = None,
        data_dir: Path | None = None,
        ready_timeout: float = 30.0,
        tcp: str | None = None,
    ):
        """``tcp``: the native listener's ``host:port`` (default: a free port)."""
        self.memory = memory
        self.extra = list(extra or [])
        self.own_dir = data_dir is None
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="kvpool-py-"))
        self.proc: subprocess.Popen | None = None
        self.addrs: dict[str, str] = {} if tcp is None else {"tcp": tcp}
        self.start(ready_timeout)

    def start(self, ready_timeout: float = 30.0) -> None:
        """Starts (or restarts) the daemon on its data directory and waits for its ready line.
        A restart binds the addresses of the first start again (``tcp``, ``resp``, ...)."""
        ports = {
            k: self.addrs.get(k, "127.0.0.1:0") for k in ("tcp", "quic", "metrics")
        }
        cmd = [
            str(kvpoold_bin()),
            "--data-dir",
            str(self.dir),
            "--memory",
            self.memory,
            "--tcp",
            ports["tcp"],
            "--quic",
            ports["quic"],
            "--metrics",
            ports["metrics"],
        ]
        extra = list(self.extra)
        # A restart keeps the front doors where clients know them.
        for flag, key in (("--resp", "resp"), ("--unix", "unix")):
            if flag in extra and key in self.addrs and self.addrs[key] != "off":
                i = extra.index(flag)
                extra[i + 1] = self.addrs[key]
        env = dict(os.environ, KVPOOL_LOG=os.environ.get("KVPOOL_LOG", "warn"))
        self.proc = subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, env=env)
        line: list[str] = []
        ready = threading.Event()

        def read_ready(proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            line.append(proc.stdout.readline().decode(errors="replace"))
            ready.set()
            for _ in proc.stdout:  # keep the pipe drained
                pass

        threading.Thread(target=read_ready, args=(self.proc,), daemon=True).start()
        ready.wait(ready_timeout)
        if not line or "kvpoold ready" not in line[0]:
            self.proc.kill()
            rc = self.proc.wait()
            raise RuntimeError(f"kvpoold did not become ready (exit {rc}): {line!r}")
        for word in line[0].split():
            if "=" in word:
                k, v = word.split("=", 1)
                self.addrs[k] = v

    @property
    def tcp(self) -> str:
        """``host:port`` of the native TCP listener."""
        return self.addrs["tcp"]

    @property
    def url(self) -> str:
        """``tcp://host:port``, what ``kvpool.Client`` takes."""
        return f"tcp://{self.tcp}"

    def addr(self, door: str) -> str:
        """The address of a listener by its ready-line name (``tcp``, ``resp``, ``unix``...)."""
        return self.addrs[door]

    def kill(self) -> None:
        """SIGKILL: the daemon dies as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def start_kvpoold():
    """A factory: ``start_kvpoold(memory="256MiB", extra=[...])`` returns a running
    :class:`Kvpoold`; every one started is stopped when the test ends."""
    started: list[Kvpoold] = []

    def start(memory: str = "256MiB", extra: list[str] | None = None, **kw) -> Kvpoold:
        d = Kvpoold(memory, extra, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


@pytest.fixture
def kvpoold(start_kvpoold) -> Kvpoold:
    """One single-node daemon on its defaults (256 MiB)."""
    return start_kvpoold()

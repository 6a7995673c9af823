"""What every engine connector stands on: a kvpool client that costs no more than a miss.

An inference engine calls its cache from its scheduler and its loader threads, in the middle of
serving. A cache that is down, slow or full must never stall or break a request; it may only make
the engine recompute. :class:`EngineStore` wraps :class:`kvpool.Client` so that:

* **every call returns a miss value and never raises**: ``0`` matched blocks, ``False`` per key
  not loaded or not stored, ``None`` for a value;
* **lookups have their own short deadline** (``lookup_timeout``, 5 ms by default) and loads and
  saves theirs (``io_timeout``): a slow node costs at most that, then counts as an error;
* **a circuit breaker** stops asking a daemon after ``failure_threshold`` failures in a row, logs
  one warning, answers misses at once, and lets one probe through every ``probe_interval``
  seconds; the first success closes it again (one info line);
* **counters** (hits, misses, errors, bytes, load latency) are kept for the engine's own metrics
  hook and for ``stats()``;
* **memory registrations survive**: a store created while kvpoold is down connects on a later
  probe and registers the engine's buffers then.

:func:`layout_salt` gives the key prefix that keeps two models, or two layouts of one model,
from ever sharing a key. The connectors are :mod:`kvpool.sglang`, :mod:`kvpool.vllm`,
:mod:`kvpool.vllm_offload` (a tier of vLLM's own OffloadingConnector), :mod:`kvpool.lmcache`
(LMCache's remote plugin) and :mod:`kvpool.lmcache_mp` (the L2 adapter of LMCache's
multiprocess server); docs/ENGINES.md says how each engine loads them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import Client, Error, Key
from ._errors import RPC_FAIL

log = logging.getLogger("kvpool.engine")

#: Upper bounds (seconds) of the load-latency histogram's buckets; the last bucket is open.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

#: Version of the key scheme below; part of every salt, so a change never reads old keys.
KEY_SCHEME = 1


def layout_salt(**fields: Any) -> str:
    """A 16-hex-digit prefix for the keys of one cache layout.

    Pass everything that changes the bytes a key stands for: the model, its dtype, the page
    (block) size in tokens, the tensor-parallel size, the layer and head geometry, the host
    layout. Two calls with the same fields give the same salt; any difference gives another
    one (xxh3-free: SHA-256 of the sorted fields, so it is stable across versions of Python)."""
    text = ";".join(f"{k}={fields[k]!r}" for k in sorted(fields))
    digest = hashlib.sha256(f"kvpool-kv-v{KEY_SCHEME};{text}".encode()).hexdigest()
    return digest[:16]


def _any_unreachable(statuses: Sequence[int]) -> bool:
    return any(s == RPC_FAIL for s in statuses)


class Counters:
    """The store's counters. Read a consistent copy with :meth:`snapshot`."""

    FIELDS = (
        "lookups",
        "hits",
        "misses",
        "errors",
        "skipped",
        "stores",
        "store_failures",
        "bytes_read",
        "bytes_written",
        "breaker_opened",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v

    def observe_load(self, seconds: float) -> None:
        i = 0
        while i < len(LATENCY_BUCKETS) and seconds > LATENCY_BUCKETS[i]:
            i += 1
        with self._lock:
            self._latency[i] += 1
            self._latency_sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """Every counter, plus ``load_latency`` (``buckets``: upper bounds; ``counts``: one
        more than the bounds, the last for slower loads; ``sum``: seconds)."""
        with self._lock:
            out: dict[str, Any] = dict(self._values)
            out["load_latency"] = {
                "buckets": list(LATENCY_BUCKETS),
                "counts": list(self._latency),
                "sum": self._latency_sum,
            }
        return out


class _Breaker:
    """closed → open after ``threshold`` consecutive failures → one probe per ``interval``."""

    def __init__(self, threshold: int, interval: float, clock: Callable[[], float]):
        self.threshold = threshold
        self.interval = interval
        self.clock = clock
        self.failures = 0
        self.open_since: float | None = None
        self.probing = False
        self.lock = threading.Lock()

    def admit(self) -> bool:
        """Whether a call may go to the daemon now."""
        with self.lock:
            if self.open_since is None:
                return True
            if not self.probing and self.clock() - self.open_since >= self.interval:
                self.probing = True  # one probe at a time; the others keep missing
                return True
            return False

    def success(self) -> bool:
        """Records a success; True when it closed an open breaker."""
        with self.lock:
            was_open = self.open_since is not None
            self.failures = 0
            self.open_since = None
            self.probing = False
            return was_open

    def failure(self) -> bool:
        """Records a failure; True when it opened the breaker (not when a probe failed)."""
        with self.lock:
            self.failures += 1
            if self.open_since is not None:
                self.open_since = (
                    self.clock()
                )  # a failed probe: wait a full interval again
                self.probing = False
                return False
            if self.failures >= self.threshold:
                self.open_since = self.clock()
                return True
            return False

    @property
    def is_open(self) -> bool:
        with self.lock:
            return self.open_since is not None


class EngineStore:
    """A kvpool client for an engine's hot path: never raises, bounded in time, observable.

    ``EngineStore(endpoint, namespace=None, token=None, lookup_timeout=0.005,
    io_timeout=2.0, failure_threshold=3, probe_interval=5.0, same_host=True)``. Construction
    never fails because kvpoold is down; the store then answers misses until a probe connects.
    """

    def __init__(
        self,
        endpoint: str,
        namespace: str | None = None,
        token: str | None = None,
        *,
        lookup_timeout: float = 0.005,
        io_timeout: float = 2.0,
        failure_threshold: int = 3,
        probe_interval: float = 5.0,
        same_host: bool = True,
        clock: Callable[[], float] = time.monotonic,
        name: str = "kvpool",
    ):
        if lookup_timeout <= 0 or io_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.endpoint = endpoint
        self.name = name
        self._args = (endpoint, namespace, token, same_host)
        self._timeouts = (lookup_timeout, io_timeout)
        self._clients: tuple[Client, Client] | None = None
        self._regs: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.counters = Counters()
        self._breaker = _Breaker(failure_threshold, probe_interval, clock)
        self._connect()

    # ----- connection and breaker -----

    def _connect(self) -> tuple[Client, Client] | None:
        """The (lookup, io) clients, connecting and registering buffers when there are none.
        Failures are recorded; None when the daemon can't be reached now."""
        with self._lock:
            if self._clients is not None or self._closed:
                return self._clients
            endpoint, ns, token, same_host = self._args
            try:
                lookup = Client(endpoint, ns, token, self._timeouts[0], same_host)
                io = Client(endpoint, ns, token, self._timeouts[1], same_host)
                for ptr, size in self._regs.items():
                    if io.register_buffer(ptr, size) != 0:
                        raise Error(f"registering {size} bytes at {ptr:#x} failed")
            except Exception as e:  # noqa: BLE001 (any failure is a miss, reported once)
                self._failed(e)
                return None
            self._clients = (lookup, io)
        self._succeeded()
        return self._clients

    def _failed(self, e: BaseException) -> None:
        self.counters.add(errors=1)
        if self._breaker.failure():
            self.counters.add(breaker_opened=1)
            log.warning(
                "%s at %s is failing (%s); answering misses and probing every %.1f s",
                self.name,
                self.endpoint,
                e,
                self._breaker.interval,
            )
        else:
            log.debug("%s at %s: %s", self.name, self.endpoint, e)

    def _succeeded(self) -> None:
        if self._breaker.success():
            log.info("%s at %s answers again", self.name, self.endpoint)

    def _call(
        self,
        which: int,
        op: Callable[[Client], Any],
        miss: Any,
        unreachable: Callable[[Any], bool] | None = None,
    ) -> Any:
        """Runs ``op`` on the lookup (0) or io (1) client through the breaker.

        A node that could not be reached counts as a failure even when the call answered
        misses for its keys (lookups, gets and prefix matches do that rather than raise): the
        client's count of unreachable nodes moved during the call. ``unreachable`` tells a
        result that reports one in its statuses (the Mooncake-style batch puts return -900 per
        key). Either way the result, with its partial successes, is still returned."""
        if self._closed or not self._breaker.admit():
            self.counters.add(skipped=1)
            return miss
        clients = self._clients or self._connect()
        if clients is None:
            return miss
        c = clients[which]
        try:
            before = c.unreachable_events()
            out = op(c)
            lost = c.unreachable_events() != before
        except Exception as e:  # noqa: BLE001 (the engine must only ever see a miss)
            self._failed(e)
            return miss
        if lost or (unreachable is not None and unreachable(out)):
            self._failed(ConnectionError("a node could not be reached"))
        else:
            self._succeeded()
        return out

    @property
    def available(self) -> bool:
        """False while the breaker is open (calls answer misses without asking)."""
        return not self._breaker.is_open and not self._closed

    @property
    def is_local(self) -> bool:
        """True when kvpoold's memory is mapped into this process (one-copy loads)."""
        clients = self._clients
        try:
            return clients is not None and clients[1].is_local()
        except Error:
            return False

    def stats(self) -> dict[str, Any]:
        """A copy of the counters (see :class:`Counters`) and whether the breaker is open."""
        out = self.counters.snapshot()
        out["available"] = self.available
        return out

    # ----- memory registration -----

    def register(self, ptr: int, size: int) -> bool:
        """Registers engine memory for the pointer calls; kept across reconnects."""
        if ptr == 0 or size <= 0:
            return False
        with self._lock:
            self._regs[ptr] = size
            clients = self._clients
        if clients is None:
            return True  # registered when a probe connects
        ok = self._call(1, lambda c: c.register_buffer(ptr, size) == 0, False)
        if not ok:
            with self._lock:  # the next connect registers it again
                self._clients = None
        return True

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._regs.pop(ptr, None)
            clients = self._clients
        if clients is not None:
            try:
                clients[1].unregister_buffer(ptr)
            except Error:
                pass

    # ----- lookups -----

    def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored (one round trip per node); 0 on any failure."""
        if not keys:
            return 0
        self.counters.add(lookups=1)
        return self._call(0, lambda c: c.match_prefix(keys), 0)

    def presence(self, keys: Sequence[Key]) -> list[bool]:
        """Per key, whether it is stored; all False on any failure."""
        if not keys:
            return []
        self.counters.add(lookups=1)
        return self._call(0, lambda c: c.batch_exists(keys), [False] * len(keys))

    # ----- loads and saves into registered memory -----

    def load(
        self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        """Copies ``keys[i]`` into ``sizes[i]`` registered bytes at ``ptrs[i]`` (one round trip
        per node). True for a key whose value filled exactly its size; a miss, a value of
        another size or any failure is False."""
        got = self._load(keys, ptrs, sizes, exact=True)
        return [g > 0 for g in got]

    def load_scattered(
        self, keys: Sequence[Key], pieces: Sequence[Sequence[tuple[int, int]]]
    ) -> list[bool]:
        """Copies ``keys[i]`` into its registered ``pieces[i]`` (``(pointer, length)`` pairs
        filled in order; one round trip per node). True for a key whose value filled exactly
        its pieces; a miss, a value of another size or any failure is False. On the same host
        the bytes go from the node's memory straight into the pieces, verified in the same
        pass; over a socket they are received straight into them, hashed as they arrive."""
        n = len(keys)
        if n == 0:
            return []
        start = time.perf_counter()
        got = self._call(
            1,
            lambda c: c.batch_get_scatter(list(keys), [list(p) for p in pieces]),
            None,
            _any_unreachable,
        )
        if got is None:
            self.counters.add(misses=n)
            return [False] * n
        sizes = [sum(length for _, length in p) for p in pieces]
        out = [g == s and g > 0 for g, s in zip(got, sizes)]
        hits = sum(out)
        self.counters.add(
            hits=hits,
            misses=n - hits,
            bytes_read=sum(s for s, o in zip(sizes, out) if o),
        )
        self.counters.observe_load(time.perf_counter() - start)
        return out

    def load_lengths(
        self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Like :meth:`load`, for slots that may hold a shorter value (LMCache's partial last
        chunk): per key the length copied into the start of its slot, or 0 for a miss, a value
        longer than its slot or any failure."""
        return self._load(keys, ptrs, sizes, exact=False)

    def _load(
        self,
        keys: Sequence[Key],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        exact: bool,
    ) -> list[int]:
        n = len(keys)
        if n == 0:
            return []
        start = time.perf_counter()
        got = self._call(
            1,
            lambda c: c.batch_get_into(list(keys), list(ptrs), list(sizes)),
            None,
            _any_unreachable,
        )
        if got is None:
            self.counters.add(misses=n)
            return [0] * n
        out = [
            g if (g == s if exact else 0 < g <= s) else 0 for g, s in zip(got, sizes)
        ]
        hits = sum(1 for g in out if g > 0)
        self.counters.add(hits=hits, misses=n - hits, bytes_read=sum(out))
        self.counters.observe_load(time.perf_counter() - start)
        return out

    def save(
        self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        """Stores ``sizes[i]`` registered bytes at ``ptrs[i]`` under ``keys[i]`` (one round trip
        per node); per key whether it was stored. A full pool is a False, not an error."""
        n = len(keys)
        if n == 0:
            return []
        st = self._call(
            1,
            lambda c: c.batch_put_from(list(keys), list(ptrs), list(sizes)),
            None,
            _any_unreachable,
        )
        if st is None:
            self.counters.add(store_failures=n)
            return [False] * n
        ok = [s == 0 for s in st]
        stored = sum(ok)
        self.counters.add(
            stores=stored,
            store_failures=n - stored,
            bytes_written=sum(s for s, o in zip(sizes, ok) if o),
        )
        return ok

    # ----- values as bytes (the engines' plain, copying interfaces) -----

    def get(self, key: Key) -> bytes | None:
        """The value of ``key``, or None (missing, or any failure)."""
        v = self._call(1, lambda c: c._read(key), None)
        if v is None:
            self.counters.add(misses=1)
        else:
            self.counters.add(hits=1, bytes_read=len(v))
        return v

    def get_into(self, key: Key, buffer: Any) -> int | None:
        """Copies the value of ``key`` into a writable buffer; its length, or None."""
        got = self._call(1, lambda c: c.read_into(key, buffer), None)
        if got is None:
            self.counters.add(misses=1)
        else:
            self.counters.add(hits=1, bytes_read=got)
        return got

    def get_many_into(
        self, keys: Sequence[Key], buffers: Sequence[Any]
    ) -> list[int | None]:
        """Copies ``keys[i]`` into the writable buffer ``buffers[i]`` (one round trip per node,
        no registration needed): per key its length, or None (missing, too large for its
        buffer, or any failure of the call)."""
        n = len(keys)
        if n == 0:
            return []
        start = time.perf_counter()
        got = self._call(1, lambda c: c.read_many_into(keys, buffers), None)
        if got is None:
            self.counters.add(misses=n)
            return [None] * n
        hits = [g for g in got if g is not None]
        self.counters.add(hits=len(hits), misses=n - len(hits), bytes_read=sum(hits))
        self.counters.observe_load(time.perf_counter() - start)
        return got

    def put(self, key: Key, value: Any) -> bool:
        """Stores ``value`` (any buffer); whether it was stored."""

        def op(c: Client) -> bool:
            c.write(key, value)
            return True

        ok = self._call(1, op, False)
        if ok:
            self.counters.add(stores=1, bytes_written=memoryview(value).nbytes)
        else:
            self.counters.add(store_failures=1)
        return ok

    def put_many(self, keys: Sequence[Key], values: Sequence[Any]) -> bool:
        """Stores every value (one round trip per node); whether all were stored."""

        def op(c: Client) -> bool:
            c.write_many(keys, values)
            return True

        ok = self._call(1, op, False)
        if ok:
            n = sum(memoryview(v).nbytes for v in values)
            self.counters.add(stores=len(keys), bytes_written=n)
        else:
            self.counters.add(store_failures=len(keys))
        return ok

    def delete(self, key: Key) -> bool:
        return self._call(1, lambda c: c.delete(key), False)

    def clear(self) -> int:
        """Removes every object of the namespace; how many, or 0 on failure."""
        return self._call(1, lambda c: c.clear(), 0)

    def close(self) -> None:
        """Closes both clients; later calls answer misses."""
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, None
        if clients is not None:
            for c in clients:
                c.close()

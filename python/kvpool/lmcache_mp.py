"""kvpool as the L2 tier of LMCache's multiprocess (MP) server, through its plugin L2 adapter.

LMCache's MP server (``lmcache server``, 0.5.6) keeps chunks in its own CPU memory (L1) and hands
them to L2 adapters; the ``plugin`` adapter type imports one from a module::

    lmcache server --l1-size-gb 20 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin", "module_path": "kvpool.lmcache_mp",
                     "class_name": "KvpoolL2Adapter",
                     "adapter_params": {"url": "kvpool://127.0.0.1:7070"}}'

LMCache finds :class:`KvpoolL2AdapterConfig` by name (``class_name`` + ``Config``), builds it
from ``adapter_params`` and passes the adapter its L1 memory descriptor. :class:`KvpoolL2Adapter`
stands on :class:`kvpool.engine.EngineStore`, so a down, slow or full kvpoold is a miss or a
failed store task, never an exception into LMCache's controllers. What each call becomes:

* ``submit_lookup_and_lock_task``: one presence call for all the keys (one round trip per node).
  LMCache asks per key, for several rows at once (object groups, kv ranks) and, under its
  ``full`` fetching policy, for chunks after a gap, so the answer is per key rather than the
  leading run ``match_prefix`` gives. kvpool has no per-client locks; a key evicted between the
  lookup and the load is a miss of the load (``submit_unlock`` has nothing to release).
* ``submit_load_task``: one ``batch_get_into`` straight into the L1 buffers (the L1 arena is
  registered with kvpool once, so on the same host a load is one copy out of kvpoold's memory,
  and over TCP the bytes land in L1 from the socket); a bit is set only for a value that filled
  its buffer exactly, checksum verified by kvpool's client.
* ``submit_store_task``: one presence call, then one ``batch_put_from`` of the chunks kvpool does
  not hold yet (one value per key). The task succeeds when every chunk is in kvpool afterwards.
* ``delete``: removes the keys (LMCache calls it only when its own L2 eviction is configured for
  the adapter; kvpool evicts by itself).

Each call runs on the adapter's own threads (one small pool per kind of task, so a long store
never delays a lookup) and signals LMCache's event fd for that kind when it is done.

Keys are ``lmcache-mp:<salt>:<model>@<kv_rank>@<object group>@<chunk hash>[@<cache salt>]``:
the fields of LMCache's ``ObjectKey``; the salt (:func:`kvpool.engine.layout_salt`) covers the
chunk's layout (every shape and dtype of the object) and the ``tag`` option, so two models, two
layouts of one model or two tags never share a key. A key longer than ``kvpool.MAX_KEY_LEN``
becomes ``lmcache-mp:<salt>:sha256:<digest>``. The value is the object's bytes exactly.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from . import MAX_KEY_LEN
from .engine import EngineStore, layout_salt
from .lmcache import endpoint_of

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

__all__ = ["KEY_PREFIX", "KvpoolL2Adapter", "KvpoolL2AdapterConfig", "layout_tag"]

log = logging.getLogger("kvpool.lmcache_mp")

#: The first part of every key this adapter writes.
KEY_PREFIX = "lmcache-mp"

_DEFAULTS: dict[str, Any] = {
    "namespace": None,
    "token": None,
    "lookup_timeout_ms": 20,
    "io_timeout_ms": 10000,
    "failure_threshold": 3,
    "probe_interval_s": 5.0,
    "same_host": True,
    "num_workers": 2,
    "tag": "",
}


class KvpoolL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's settings, from the plugin's ``adapter_params``.

    ``url`` (required): ``kvpool://host:port`` or ``kvpool:///path/kvpoold.sock`` (``?namespace=``
    optional), or a kvpool endpoint (``tcp://``, ``unix://``, ``quic://``). ``namespace`` (the
    URL's, else kvpoold's ``default``), ``token`` (none), ``lookup_timeout_ms`` (20),
    ``io_timeout_ms`` (10000: one call carries a whole store or load task, which can be every
    chunk of a request), ``failure_threshold`` (3), ``probe_interval_s`` (5), ``same_host``
    (true; false sends every byte over the socket), ``num_workers`` (2 threads per kind of
    task), ``tag`` (empty; any string, part of the key salt: separate tenants)."""

    def __init__(self, url: str, **options: Any) -> None:
        unknown = sorted(set(options) - set(_DEFAULTS))
        if unknown:
            raise ValueError(
                f"unknown kvpool L2 adapter option(s): {', '.join(unknown)}"
            )
        if not isinstance(url, str) or not url:
            raise ValueError("url must be kvpool://host:port or a kvpool endpoint")
        if url.startswith("kvpool://"):
            self.endpoint, url_ns = endpoint_of(url)
        elif url.split("://", 1)[0] in ("tcp", "unix", "quic", "tls"):
            self.endpoint, url_ns = url, None
        else:
            raise ValueError(
                f"url must be kvpool://host:port or a kvpool endpoint: {url!r}"
            )
        opts = {**_DEFAULTS, **options}
        self.url = url
        self.namespace: str | None = opts["namespace"] or url_ns
        self.token: str | None = opts["token"]
        self.lookup_timeout = (
            _positive(opts["lookup_timeout_ms"], "lookup_timeout_ms") / 1000
        )
        self.io_timeout = _positive(opts["io_timeout_ms"], "io_timeout_ms") / 1000
        self.failure_threshold = int(
            _positive(opts["failure_threshold"], "failure_threshold")
        )
        self.probe_interval = _positive(opts["probe_interval_s"], "probe_interval_s")
        self.same_host = _flag(opts["same_host"])
        self.num_workers = L2AdapterConfigBase._validate_num_workers(
            opts["num_workers"]
        )
        self.tag = str(opts["tag"])

    @classmethod
    def from_dict(cls, d: dict) -> KvpoolL2AdapterConfig:
        d = {k: v for k, v in d.items() if k != "type"}
        if "url" not in d:
            raise ValueError("adapter_params needs url (kvpool://host:port)")
        return cls(**d)

    @classmethod
    def help(cls) -> str:
        return (
            "kvpool L2 adapter (plugin, module_path kvpool.lmcache_mp, class_name "
            "KvpoolL2Adapter); adapter_params:\n"
            "- url (str): kvpool://host:port, kvpool:///path.sock or tcp://host:port "
            "(required)\n"
            "- namespace, token (str): kvpool namespace and its token (optional)\n"
            "- lookup_timeout_ms (20), io_timeout_ms (10000), failure_threshold (3), "
            "probe_interval_s (5)\n"
            "- same_host (bool, true): use the same-host path when kvpoold is local\n"
            "- num_workers (int, 2): threads per kind of task\n"
            "- tag (str): part of the key salt; separates tenants"
        )


def layout_tag(shapes: Sequence[Any], dtypes: Sequence[Any]) -> str:
    """The layout of an object as a string: its shapes and dtypes, e.g.
    ``2x32x256x1024:bfloat16``; one part per tensor, joined by ``;``."""
    return ";".join(
        "x".join(str(int(d)) for d in shape) + ":" + str(dtype).removeprefix("torch.")
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )


class KvpoolL2Adapter(L2AdapterInterface):
    """LMCache's L2 adapter interface on kvpool (see the module's docstring).

    ``KvpoolL2Adapter(config, l1_memory_desc=None, *, store=None)``: ``config`` is a
    :class:`KvpoolL2AdapterConfig` or its ``adapter_params`` dict; ``l1_memory_desc`` LMCache's
    L1 arena, registered with kvpool for the pointer calls (without it, or for an object outside
    it, the bytes take a copying call); ``store`` lets a caller pass its own EngineStore.
    Construction does not need kvpoold to be up."""

    def __init__(
        self,
        config: KvpoolL2AdapterConfig | dict,
        l1_memory_desc: L1MemoryDesc | None = None,
        *,
        store: EngineStore | None = None,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = KvpoolL2AdapterConfig.from_dict(config)
        self.config = config
        self.store = store or EngineStore(
            config.endpoint,
            config.namespace,
            config.token,
            lookup_timeout=config.lookup_timeout,
            io_timeout=config.io_timeout,
            failure_threshold=config.failure_threshold,
            probe_interval=config.probe_interval,
            same_host=config.same_host,
            name="kvpool (LMCache L2 adapter)",
        )
        self._arena: tuple[int, int] | None = None
        if (
            l1_memory_desc is not None
            and l1_memory_desc.ptr
            and l1_memory_desc.size > 0
        ):
            size = l1_memory_desc.stable_registration_size or l1_memory_desc.size
            if self.store.register(l1_memory_desc.ptr, size):
                self._arena = (l1_memory_desc.ptr, size)
        self._lanes = {
            kind: _Lane(kind, config.num_workers)
            for kind in ("store", "lookup", "load")
        }
        self._lock = threading.Lock()
        self._next_task: L2TaskId = 0
        self._salts: dict[str, str] = {}
        # kvpool key and size of every key this adapter stored, for LMCache's byte accounting
        # and for deleting a key whose layout LMCache no longer says.
        self._stored: dict[ObjectKey, tuple[str, int]] = {}
        log.info(
            "LMCache L2 adapter on %s (L1 arena %s)",
            config.endpoint,
            "registered" if self._arena else "not registered: copying calls",
        )

    # ----- event fds -----

    def get_store_event_fd(self) -> int:
        return self._lanes["store"].fd

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lanes["lookup"].fd

    def get_load_event_fd(self) -> int:
        return self._lanes["load"].fd

    # ----- store -----

    def submit_store_task(
        self, keys: list[ObjectKey], objects: list[MemoryObj]
    ) -> L2TaskId:
        task = self._task_id()
        self._lanes["store"].submit(
            task, lambda: self._store(keys, objects), L2StoreResult(False, 0)
        )
        return task

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._lanes["store"].pop_all()

    # ----- lookup -----

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        task = self._task_id()
        self._lanes["lookup"].submit(
            task, lambda: self._lookup(keys, group_layout_descs), Bitmap(len(keys))
        )
        return task

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lanes["lookup"].pop(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to release: a lookup takes no lock in kvpool (see the module's docstring)."""

    # ----- load -----

    def submit_load_task(
        self, keys: list[ObjectKey], objects: list[MemoryObj]
    ) -> L2TaskId:
        task = self._task_id()
        self._lanes["load"].submit(
            task, lambda: self._load(keys, objects), Bitmap(len(keys))
        )
        return task

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lanes["load"].pop(task_id)

    # ----- eviction, status, close -----

    def delete(self, keys: list[ObjectKey]) -> None:
        """Removes ``keys`` from kvpool. A key this adapter did not store is tried under every
        layout it has seen. Never raises."""
        deleted: list[ObjectKey] = []
        sizes: list[int] = []
        for key in keys:
            with self._lock:
                known = self._stored.pop(key, None)
                salts = list(self._salts.values())
            names = [known[0]] if known else [self._name(s, key) for s in salts]
            removed = [self.store.delete(n) for n in names]  # every one, no short cut
            if known or any(removed):
                deleted.append(key)
                sizes.append(known[1] if known else 0)
        if deleted:
            self._notify_keys_deleted(deleted, sizes)

    def report_status(self) -> dict:
        stats = self.store.stats()
        return {
            "is_healthy": bool(stats["available"]),
            "type": type(self).__name__,
            "endpoint": self.config.endpoint,
            "same_host": self.store.is_local,
            "l1_registered": self._arena is not None,
            **{
                k: v for k, v in stats.items() if k not in ("available", "load_latency")
            },
        }

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown()
        if self._arena is not None:
            self.store.unregister(self._arena[0])
        self.store.close()
        for lane in self._lanes.values():
            lane.close_fd()

    # ----- keys -----

    def kvpool_key(self, key: ObjectKey, layout: str) -> str:
        """The kvpool key of ``key`` for an object of layout ``layout`` (:func:`layout_tag`)."""
        return self._name(self._salt(layout), key)

    def _salt(self, layout: str) -> str:
        with self._lock:
            salt = self._salts.get(layout)
            if salt is None:
                salt = layout_salt(
                    engine="lmcache-mp", layout=layout, tag=self.config.tag
                )
                self._salts[layout] = salt
            return salt

    @staticmethod
    def _name(salt: str, key: ObjectKey) -> str:
        s = f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
        if key.cache_salt:
            s += f"@{key.cache_salt}"
        full = f"{KEY_PREFIX}:{salt}:{s}"
        if len(full.encode()) <= MAX_KEY_LEN:
            return full
        return f"{KEY_PREFIX}:{salt}:sha256:{hashlib.sha256(s.encode()).hexdigest()}"

    def _object_key(self, key: ObjectKey, obj: MemoryObj) -> str:
        # An object made with one shape carries ``shape``/``dtype`` only, not the lists.
        meta = obj.metadata
        shapes = meta.shapes if meta.shapes is not None else [meta.shape]
        dtypes = meta.dtypes if meta.dtypes is not None else [meta.dtype]
        return self.kvpool_key(key, layout_tag(shapes, dtypes))

    def _task_id(self) -> L2TaskId:
        with self._lock:
            self._next_task += 1
            return self._next_task

    def _in_arena(self, ptr: int, size: int) -> bool:
        a = self._arena
        return a is not None and a[0] <= ptr and ptr + size <= a[0] + a[1]

    # ----- the work of each task, on the lanes' threads -----

    def _lookup(
        self, keys: list[ObjectKey], layouts: dict[int, MemoryLayoutDesc]
    ) -> Bitmap:
        """One presence call. A key whose object group comes without a layout, or with an
        empty one (LMCache's prefetch controller always passes them; its adapter check and
        bench do not), is looked up under every layout this adapter has stored or loaded."""
        bitmap = Bitmap(len(keys))
        asked: list[int] = []
        names: list[str] = []
        seen: list[str] | None = None
        for i, key in enumerate(keys):
            desc = layouts.get(key.object_group_id)
            if desc is not None and desc.shapes:
                asked.append(i)
                names.append(self.kvpool_key(key, layout_tag(desc.shapes, desc.dtypes)))
                continue
            if seen is None:
                with self._lock:
                    seen = list(self._salts.values())
            for salt in seen:
                asked.append(i)
                names.append(self._name(salt, key))
        for i, present in zip(asked, self.store.presence(names)):
            if present:
                bitmap.set(i)
        return bitmap

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        n = len(keys)
        names = [self._object_key(k, o) for k, o in zip(keys, objects, strict=True)]
        sizes = [o.get_size() for o in objects]
        ok = [False] * n
        direct = [i for i in range(n) if self._in_arena(objects[i].data_ptr, sizes[i])]
        if direct:
            got = self.store.load(
                [names[i] for i in direct],
                [objects[i].data_ptr for i in direct],
                [sizes[i] for i in direct],
            )
            for i, g in zip(direct, got):
                ok[i] = g
        copied = sorted(set(range(n)) - set(direct))
        if copied:
            got_len = self.store.get_many_into(
                [names[i] for i in copied], [objects[i].byte_array for i in copied]
            )
            for i, g in zip(copied, got_len):
                ok[i] = g == sizes[i]
        bitmap = Bitmap(n)
        for i in range(n):
            if ok[i]:
                bitmap.set(i)
        loaded = [keys[i] for i in range(n) if ok[i]]
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        n = len(keys)
        if n == 0:
            return L2StoreResult(True, 0)
        names = [self._object_key(k, o) for k, o in zip(keys, objects, strict=True)]
        sizes = [o.get_size() for o in objects]
        held = self.store.presence(names)
        todo = [i for i in range(n) if not held[i]]
        direct = [i for i in todo if self._in_arena(objects[i].data_ptr, sizes[i])]
        stored = [False] * n
        if direct:
            ok = self.store.save(
                [names[i] for i in direct],
                [objects[i].data_ptr for i in direct],
                [sizes[i] for i in direct],
            )
            for i, o in zip(direct, ok):
                stored[i] = o
        copied = sorted(set(todo) - set(direct))
        if copied and self.store.put_many(
            [names[i] for i in copied], [objects[i].byte_array for i in copied]
        ):
            for i in copied:
                stored[i] = True
        new: list[int] = []
        with self._lock:
            for i in range(n):
                if (stored[i] or held[i]) and keys[i] not in self._stored:
                    self._stored[keys[i]] = (names[i], sizes[i])
                    new.append(i)
        if new:
            self._notify_keys_stored([keys[i] for i in new], [sizes[i] for i in new])
        success = all(stored[i] or held[i] for i in range(n))
        return L2StoreResult(success, sum(sizes[i] for i in range(n) if stored[i]))


class _Lane:
    """One kind of task: its threads, its finished results, its event fd."""

    def __init__(self, kind: str, workers: int) -> None:
        self.kind = kind
        self._notifier = create_event_notifier()
        self.fd = self._notifier.fileno()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"kvpool-l2-{kind}"
        )
        self._done: dict[L2TaskId, Any] = {}
        self._lock = threading.Lock()

    def submit(self, task: L2TaskId, work: Callable[[], Any], failed: Any) -> None:
        """Runs ``work`` on the lane's threads; its result (``failed`` if it raised, which
        :class:`EngineStore` never does) is posted under ``task`` and the fd signalled."""

        def run() -> None:
            try:
                result = work()
            except Exception:  # LMCache must get an answer for every task
                log.exception("kvpool L2 %s task %d failed", self.kind, task)
                result = failed
            with self._lock:
                self._done[task] = result
            self._notifier.notify()

        self._pool.submit(run)

    def pop(self, task: L2TaskId) -> Any:
        with self._lock:
            return self._done.pop(task, None)

    def pop_all(self) -> dict[L2TaskId, Any]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def close_fd(self) -> None:
        self._notifier.close()


def _positive(v: Any, name: str) -> float:
    x = float(v)
    if x <= 0:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return x


def _flag(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)

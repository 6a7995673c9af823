"""kvpool as an LMCache remote store: ``kvpool://host:port`` through LMCache's plugin mechanism.

LMCache (0.5.6) loads this module when its config lists the plugin::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.lmcache
      remote_storage_plugin.kvpool.class_name: KvpoolConnectorAdapter
      remote_storage_plugin.kvpool.url: "kvpool://127.0.0.1:7070"

LMCache's ``ConnectorManager`` imports the module, instantiates :class:`KvpoolConnectorAdapter`
and asks it for a connector for the URL ``plugin://kvpool``; the adapter builds a
:class:`KvpoolRemoteConnector` on :class:`kvpool.engine.EngineStore` (the native client, not
RESP). So LMCache gets:

* **one round trip per node for a batch**: ``batched_async_contains`` / ``batched_contains`` are
  one ``match_prefix``; ``batched_get`` is one ``batch_get_into`` straight into the memory of the
  ``MemoryObj``\\ s that LMCache's local CPU backend allocates (its arena is registered once, so
  a load is one copy, out of kvpoold's mapped memory when it runs on the same host);
  ``batched_put`` is one ``batch_put_from`` from that memory;
* **a miss, never an exception**: a down, slow or full kvpoold costs a miss (``False``, ``0``,
  ``None``) within the EngineStore's deadlines, behind its circuit breaker;
* **no blocking call on LMCache's event loop**: every network call runs on the connector's own
  small thread pool.

Keys are ``lmcache:<salt>:<CacheEngineKey.to_string()>``: the key string already names the
model, the world size, the worker, the chunk hash and the KV dtype; ``salt`` (16 hex digits,
:func:`kvpool.engine.layout_salt`) adds the chunk size and the memory format (``KV_2LTD`` or
``KV_MLA_FMT``), so no two layouts ever read each other's bytes. A key longer than
``kvpool.MAX_KEY_LEN`` is replaced by the SHA-256 of its LMCache part. The value is the chunk's
bytes exactly (``MemoryObj.byte_array``), without LMCache's remote metadata header: the shape
is known locally, and a partial last chunk (``save_unfull_chunk: true``) is a shorter value
that a get reshapes with LMCache's own ``reshape_partial_chunk``.

Options (``extra_config``, each ``remote_storage_plugin.<name>.<option>``, ``<name>`` being the
plugin's name in ``remote_storage_plugins``): ``url`` (``kvpool://host:port``, or
``kvpool:///path/to/kvpoold.sock`` for a Unix socket; ``?namespace=NS`` optional), ``namespace``,
``token``, ``lookup_timeout_ms`` (default 20), ``io_timeout_ms`` (2000), ``failure_threshold``
(3), ``probe_interval_s`` (5), ``same_host`` (true), ``io_threads`` (4). docs/ENGINES.md has
the details.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from . import MAX_KEY_LEN
from .engine import EngineStore, layout_salt

__all__ = [
    "PLUGIN_TYPE",
    "SCHEME",
    "KvpoolConnectorAdapter",
    "KvpoolRemoteConnector",
    "endpoint_of",
]

log = logging.getLogger("kvpool.lmcache")

#: The plugin type: ``remote_storage_plugins: ["kvpool"]`` (or ``"kvpool.<instance>"``).
PLUGIN_TYPE = "kvpool"
#: The URL scheme the adapter answers to, besides ``plugin://kvpool``.
SCHEME = "kvpool://"

_T = TypeVar("_T")


def endpoint_of(url: str) -> tuple[str, str | None]:
    """The kvpool endpoint and the namespace (or None) of a ``kvpool://`` URL:
    ``kvpool://host:port[?namespace=NS]`` is ``tcp://host:port``;
    ``kvpool:///path/kvpoold.sock`` is ``unix:///path/kvpoold.sock``. Raises ValueError."""
    u = urlparse(url)
    if u.scheme != "kvpool":
        raise ValueError(f"not a kvpool:// URL: {url!r}")
    ns = parse_qs(u.query).get("namespace", [None])[0]
    if u.netloc:
        try:
            port = u.port
        except ValueError as e:
            raise ValueError(f"bad port in {url!r}: {e}") from None
        if not u.hostname or port is None:
            raise ValueError(f"{url!r} needs a host and a port")
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        return f"tcp://{host}:{port}", ns
    if u.path:
        return f"unix://{u.path}", ns
    raise ValueError(f"{url!r} names no address")


def _options(config: LMCacheEngineConfig | None, plugin_name: str) -> dict[str, Any]:
    """The plugin's options from ``extra_config``: the instance's keys first, then the type's."""
    extra = (config.extra_config if config is not None else None) or {}
    out: dict[str, Any] = {}
    for name in (PLUGIN_TYPE, plugin_name):  # the instance overrides the type
        prefix = f"remote_storage_plugin.{name}."
        for k, v in extra.items():
            if isinstance(k, str) and k.startswith(prefix):
                out[k[len(prefix) :]] = v
    return out


def _flag(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)


class KvpoolRemoteConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` on kvpool's native client (:class:`EngineStore`).

    ``KvpoolRemoteConnector(loop, local_cpu_backend, config, metadata=None, *, url=None,
    plugin_name="kvpool", store=None)``. ``url`` defaults to the ``url`` option; ``metadata``
    to the backend's. The keyword-only ``store`` lets a caller pass its own EngineStore.
    Construction raises only on a bad configuration (LMCache logs it and runs without the
    remote backend); it does not need kvpoold to be up."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: LMCacheEngineConfig | None,
        metadata: LMCacheMetadata | None = None,
        *,
        url: str | None = None,
        plugin_name: str = PLUGIN_TYPE,
        store: EngineStore | None = None,
    ):
        config = config if config is not None else local_cpu_backend.config
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        super().__init__(config, metadata)
        assert metadata is not None  # the base class asserts it too
        opts = _options(config, plugin_name)
        url = url if url is not None and url.startswith(SCHEME) else opts.get("url")
        if not url:
            raise ValueError(
                f"kvpool plugin {plugin_name!r}: set extra_config"
                f"['remote_storage_plugin.{plugin_name}.url'] to kvpool://host:port"
            )
        endpoint, url_ns = endpoint_of(str(url))
        self.url = str(url)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.salt = layout_salt(
            engine="lmcache",
            chunk_size=metadata.chunk_size,
            fmt=self.meta_fmt.name,
        )
        self._prefix = f"lmcache:{self.salt}:"
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, int(opts.get("io_threads", 4))),
            thread_name_prefix="kvpool-lmcache",
        )
        self.store = store or EngineStore(
            endpoint,
            opts.get("namespace", url_ns),
            opts.get("token"),
            lookup_timeout=float(opts.get("lookup_timeout_ms", 20)) / 1000,
            io_timeout=float(opts.get("io_timeout_ms", 2000)) / 1000,
            failure_threshold=int(opts.get("failure_threshold", 3)),
            probe_interval=float(opts.get("probe_interval_s", 5.0)),
            same_host=_flag(opts.get("same_host", True)),
            name=f"kvpool (LMCache plugin {plugin_name})",
        )
        self._arenas: list[tuple[int, int]] = []
        self._register_arenas()
        log.info(
            "LMCache plugin %s on %s (keys %s*, %d registered arena(s))",
            plugin_name,
            endpoint,
            self._prefix,
            len(self._arenas),
        )

    # ----- keys and memory -----

    def kvpool_key(self, key: CacheEngineKey) -> str:
        """The kvpool key of an LMCache key (see the module's docstring)."""
        s = key.to_string()
        full = self._prefix + s
        if len(full.encode()) <= MAX_KEY_LEN:
            return full
        return self._prefix + "sha256:" + hashlib.sha256(s.encode()).hexdigest()

    def _register_arenas(self) -> None:
        """Registers the local CPU backend's arena(s), once, so that gets and puts are pointer
        calls into them. An allocator without a known arena leaves the copying path."""
        alloc = getattr(self.local_cpu_backend, "memory_allocator", None)
        if alloc is None:
            return  # the scheduler role: no MemoryObjs here
        seen: set[int] = set()
        for holder in (getattr(alloc, "pin_allocator", None), alloc):
            buf = getattr(holder, "buffer", None)
            if buf is None or not hasattr(buf, "data_ptr"):
                continue
            if getattr(getattr(buf, "device", None), "type", "cpu") != "cpu":
                continue
            ptr, size = int(buf.data_ptr()), int(buf.numel() * buf.element_size())
            if ptr in seen or size <= 0:
                continue
            seen.add(ptr)
            if self.store.register(ptr, size):
                self._arenas.append((ptr, size))

    def _in_arena(self, ptr: int, size: int) -> bool:
        return any(a <= ptr and ptr + size <= a + n for a, n in self._arenas)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Runs a blocking call on the connector's threads, never on LMCache's loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ----- lookups -----

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.store.match_prefix([self.kvpool_key(key)]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading keys kvpool holds: one ``match_prefix`` (one round trip per node)."""
        return self.store.match_prefix([self.kvpool_key(k) for k in keys])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """:meth:`batched_contains` off the loop (``pin`` has no meaning in kvpool)."""
        if not keys:
            return 0
        return await self._run(self.batched_contains, keys)

    # ----- gets -----

    def _allocate(self) -> MemoryObj | None:
        try:
            try:
                return self.local_cpu_backend.allocate(
                    self.meta_shapes, self.meta_dtypes, self.meta_fmt, busy_loop=False
                )
            except TypeError:  # an allocator backend without LocalCPUBackend's options
                return self.local_cpu_backend.allocate(
                    self.meta_shapes, self.meta_dtypes, self.meta_fmt
                )
        except Exception as e:  # noqa: BLE001 (no memory is a miss)
            log.debug("kvpool: no local CPU memory for a get: %s", e)
            return None

    def _load(
        self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj | None]
    ) -> list[MemoryObj | None]:
        """Fills the MemoryObjs (one batch call for those in a registered arena, a copying
        get for any other); a miss releases its MemoryObj and is None."""
        n = len(keys)
        lengths = [0] * n
        try:
            direct = [
                i
                for i, o in enumerate(objs)
                if o is not None and self._in_arena(o.data_ptr, o.get_size())
            ]
            if direct:
                got = self.store.load_lengths(
                    [self.kvpool_key(keys[i]) for i in direct],
                    [objs[i].data_ptr for i in direct],  # type: ignore[union-attr]
                    [objs[i].get_size() for i in direct],  # type: ignore[union-attr]
                )
                for i, g in zip(direct, got):
                    lengths[i] = g
            copied = set(direct)
            for i, o in enumerate(objs):
                if o is not None and i not in copied:
                    got_one = self.store.get_into(
                        self.kvpool_key(keys[i]), o.byte_array
                    )
                    lengths[i] = got_one or 0
        except Exception as e:  # noqa: BLE001 (whatever happened, these are misses)
            log.warning("kvpool: a get failed: %s", e)
            lengths = [0] * n
        out: list[MemoryObj | None] = []
        for o, length in zip(objs, lengths):
            if o is None:
                out.append(None)
                continue
            if length > 0:
                try:
                    out.append(self.reshape_partial_chunk(o, length))
                    continue
                except ValueError as e:  # a length that is no whole number of tokens
                    log.debug("kvpool: unusable value of %d bytes: %s", length, e)
            o.ref_count_down()
            out.append(None)
        return out

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One MemoryObj per key (None for a miss), loaded by one ``batch_get_into``."""
        if not keys:
            return []
        objs = [self._allocate() for _ in keys]
        job = self._pool.submit(self._load, keys, objs)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # LMCache gave up (its own timeout). The copy may still be running into these
            # MemoryObjs: release them only once it has finished, never under its feet.
            job.add_done_callback(lambda f: _release_when_done(f, objs))
            raise

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        """The leading run of loaded chunks; every chunk after the first miss is released."""
        got = await self.batched_get(keys)
        out: list[MemoryObj] = []
        for i, o in enumerate(got):
            if o is None:
                for rest in got[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(o)
        return out

    # ----- puts -----

    def _save(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        try:
            direct = [
                i
                for i, o in enumerate(objs)
                if self._in_arena(o.data_ptr, o.get_size())
            ]
            if direct:
                self.store.save(
                    [self.kvpool_key(keys[i]) for i in direct],
                    [objs[i].data_ptr for i in direct],
                    [objs[i].get_size() for i in direct],
                )
            copied = set(direct)
            rest = [i for i in range(len(objs)) if i not in copied]
            if rest:
                self.store.put_many(
                    [self.kvpool_key(keys[i]) for i in rest],
                    [objs[i].byte_array for i in rest],
                )
        except Exception as e:  # noqa: BLE001 (a failed store is a later recompute)
            log.warning("kvpool: a put failed: %s", e)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(
        self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]
    ) -> None:
        """Stores the chunks with one ``batch_put_from``. LMCache drops its references when
        this returns (its wrapper does), so the bytes are sent before it returns. A failed
        store is counted, never raised: the chunk is recomputed next time."""
        if not keys:
            return
        job = self._pool.submit(self._save, keys, memory_objs)
        try:
            await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # LMCache drops its references when this returns; the send may still be reading
            # the MemoryObjs, so hold them until it has finished.
            for o in memory_objs:
                o.ref_count_up()
            job.add_done_callback(lambda _f: _release(memory_objs))
            raise

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    # ----- the rest of the interface -----

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return bool(self.store.delete(self.kvpool_key(key)))

    async def list(self) -> list[str]:
        """Always empty: kvpool's native client has no key listing (LMCache does not need
        one for serving; the RESP door's ``SCAN MATCH lmcache:*`` lists the keys)."""
        return []

    def stats(self) -> dict[str, Any]:
        """The EngineStore's counters (hits, misses, errors, bytes, load latency)."""
        return self.store.stats()

    async def close(self) -> None:
        """Closes the client; later calls answer misses."""
        await self._run(self._close)
        self._pool.shutdown(wait=False)

    def _close(self) -> None:
        for ptr, _ in self._arenas:
            self.store.unregister(ptr)
        self._arenas.clear()
        self.store.close()

    def __repr__(self) -> str:
        return f"<KvpoolRemoteConnector {self.url}>"


def _release(objs: Sequence[MemoryObj | None]) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


def _release_when_done(
    job: concurrent.futures.Future, objs: Sequence[MemoryObj | None]
) -> None:
    """Releases what an abandoned get holds: its results once it finished (it released its
    misses itself), or every MemoryObj when it never ran."""
    if job.cancelled() or job.exception() is not None:
        _release(objs)
    else:
        _release(job.result())


class KvpoolConnectorAdapter(ConnectorAdapter):
    """The ``ConnectorAdapter`` LMCache instantiates from ``remote_storage_plugin.<name>.
    class_name``: it answers ``plugin://kvpool[.<instance>]`` and ``kvpool://...`` URLs."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        if url.startswith("plugin://"):
            return extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE
        return False

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        plugin_name = context.plugin_name
        if plugin_name is None and context.url.startswith("plugin://"):
            plugin_name = context.url[len("plugin://") :]
        return KvpoolRemoteConnector(
            context.loop,
            context.local_cpu_backend,
            context.config,
            context.metadata,
            url=context.url,
            plugin_name=plugin_name or PLUGIN_TYPE,
        )

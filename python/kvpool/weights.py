"""Model weights in the pool (docs/WEIGHTS.md): safetensors checkpoints published tensor by
tensor as pinned, checksummed chunks spread over every node, and loaded back in parallel.

.. code-block:: python

    import kvpool, kvpool.weights as kw

    kv = kvpool.Client("tcp://127.0.0.1:7370")
    kw.publish(kv, "minilm", ["/models/minilm"])      # a directory, files, or a shard index
    arrays = kw.load(kv, "minilm")                    # {name: numpy.ndarray}
    state = kw.load_torch(kv, "minilm")               # {name: torch.Tensor}
    for name, a in kw.weight_iterator(kv, "minilm"):  # file order, first tensor at once
        ...
    got = kw.ensure(kv, "minilm", "/models/minilm")   # the pool, or publish once per host

Every function takes a :class:`kvpool.Client` (any namespace: the weights live in
``namespace``, ``"weights"`` by default, which every node has) and raises :class:`kvpool.Error`
subclasses: :class:`kvpool.NotFoundError` for a model, tensor or chunk that is not there,
:class:`kvpool.InvalidArgumentError` for a file that is not valid safetensors or a bad
argument, :class:`kvpool.BufferTooSmallError` for a buffer of the wrong size,
:class:`kvpool.PoolFullError` when the namespace's quota is exhausted (nothing of the
publication is kept), and ``OSError`` (``FileNotFoundError``...) for a file that can't be read.

Every tensor returned is a copy in memory of its own, each chunk verified against the
manifest's xxh3 on the way; the pool keeps its copy pinned, so the arrays may be kept, written
and freed at will.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import numpy as np

from . import _native
from ._errors import InvalidArgumentError, NotFoundError
from ._weights_load import (
    _GROUP_BYTES,
    _check_unique,
    _fetch_arrays,
    _groups,
    _load_arrays,
    _load_raw,
    _to_torch,
)
from ._weights_manifest import (
    DEFAULT_NAMESPACE,
    ExtraFile,
    File,
    Manifest,
    Tensor,
    _view,
    numpy_dtype,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

    from . import Client

__all__ = [
    "DEFAULT_NAMESPACE",
    "Ensured",
    "ExtraFile",
    "File",
    "Manifest",
    "Tensor",
    "ensure",
    "extra",
    "get_sharded",
    "load",
    "load_into",
    "load_torch",
    "lock_dir",
    "ls",
    "manifest",
    "numpy_dtype",
    "publish",
    "rm",
    "stats",
    "torch_dtype",
    "weight_iterator",
    "write_files",
]

PathLike = Union[str, "os.PathLike[str]"]


# ----- publish, inspect, remove -----


def publish(
    client: Client,
    name: str,
    paths: PathLike | Sequence[PathLike],
    *,
    chunk_size: Optional[int] = None,  # noqa: UP045
    replicas: Optional[int] = None,  # noqa: UP045
    namespace: str = DEFAULT_NAMESPACE,
) -> Manifest:
    """Publishes model ``name`` from ``paths``: ``.safetensors`` files, a sharded checkpoint's
    ``*.index.json`` (with the files it names, from its directory) or directories (every file
    under them, named relative to them: a Hugging Face model directory as it is). Other files
    (configs, tokenizers) are stored whole as companion files. Tensors are cut into chunks of
    at most ``chunk_size`` bytes (default 16 MiB), stored pinned; ``replicas`` is checked
    against what the namespace keeps. The manifest is written last, so the model is visible
    only once complete; an earlier publication of the name is replaced. Returns the manifest.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    model = _native._weights_publish(
        client,
        namespace,
        name,
        [os.fspath(p) for p in paths],
        chunk_size,
        replicas,
    )
    return _view(model, namespace)


def manifest(
    client: Client, name: str, *, namespace: str = DEFAULT_NAMESPACE
) -> Optional[Manifest]:  # noqa: UP045
    """The manifest of model ``name``, None when it is not published."""
    model = _native._weights_manifest(client, namespace, name)
    return None if model is None else _view(model, namespace)


def _require(client: Client, name: str | Manifest, namespace: str) -> Manifest:
    if isinstance(name, Manifest):
        return name
    m = manifest(client, name, namespace=namespace)
    if m is None:
        raise NotFoundError(f"no model {name!r} in the pool")
    return m


def ls(client: Client, *, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """The names of the published models, sorted."""
    return _native._weights_list(client, namespace)


def rm(client: Client, name: str, *, namespace: str = DEFAULT_NAMESPACE) -> bool:
    """Removes model ``name`` (its manifest first, so no new load starts, then its pieces).
    Returns False when it was not published."""
    return _native._weights_remove(client, namespace, name)


def stats(
    client: Client, name: str | Manifest, *, namespace: str = DEFAULT_NAMESPACE
) -> dict[str, Any]:
    """Where the model's chunks are now: ``tensor_bytes``, ``tensors``, ``chunks``,
    ``replicas`` (copies kept of each), ``nodes`` (``(node id, chunk copies, bytes)`` per node),
    ``under_replicated`` and ``missing`` (chunks short of copies, with none), and
    ``namespace_hits`` (reads of the weights namespace that found their object)."""
    m = _require(client, name, namespace)
    return _native._weights_stats(client, m.namespace, m._native)


def extra(
    client: Client,
    name: str | Manifest,
    file: str,
    *,
    namespace: str = DEFAULT_NAMESPACE,
) -> bytes:
    """The bytes of companion file ``file`` (e.g. ``"config.json"``), checked against the
    manifest. Raises :class:`kvpool.NotFoundError` when the model has no such file."""
    m = _require(client, name, namespace)
    for e in m.extra:
        if e.name == file:
            return _native._weights_extra(client, m.namespace, m._native, e.index)
    raise NotFoundError(f"model {m.name!r} has no file {file!r}")


def write_files(
    client: Client,
    name: str | Manifest,
    out_dir: PathLike,
    *,
    source: Optional[PathLike] = None,  # noqa: UP045
    namespace: str = DEFAULT_NAMESPACE,
) -> dict[str, int]:
    """Writes the model's files into ``out_dir``, byte for byte as published (what
    ``kvpool weights get`` does). Chunks missing from the pool are read from the directory
    ``source`` when given, and put back. Returns the load's report (see :func:`load_into`)."""
    m = _require(client, name, namespace)
    return _native._weights_write_files(
        client,
        m.namespace,
        m._native,
        os.fspath(out_dir),
        None if source is None else os.fspath(source),
    )


def load(
    client: Client,
    name: str | Manifest,
    *,
    rank: Optional[int] = None,  # noqa: UP045
    copy: bool = False,
    verify: bool = True,
    namespace: str = DEFAULT_NAMESPACE,
) -> dict[str, np.ndarray]:
    """Every tensor of model ``name`` (of ``rank``'s files in a per-rank checkpoint; all files
    for None) as numpy arrays of their dtype and shape, in file order, verified against the
    manifest. See :func:`numpy_dtype` for ``BF16`` and ``F8_*`` (``ml_dtypes`` types when
    installed, else the raw bits as ``uint16``/``uint8``: ``load_torch`` gives real
    ``bfloat16`` tensors).

    On the same host as the pool's nodes, each array is a **read-only view of the pool's
    memory**: no copy at all; the chunks are held where they are (not evicted, moved or reused,
    a removal waiting) until the last array over them is gone, and are checked against the
    manifest once, when the views are made (hashing every byte on every core).
    ``verify=False`` makes views without reading them: each chunk's checksum as its node
    recorded it when it checked the bytes it received is compared with the manifest, and the
    memory itself is trusted (only another process of this host writing into the pool's
    segments could have changed it since). Tensors not on this host, or all with
    ``copy=True``, are fetched in parallel from every node into fresh writable arrays, always
    verified. Raises :class:`kvpool.NotFoundError` when the model is not published or a chunk
    is in no copy (use :func:`ensure` to read those from the files)."""
    m = _require(client, name, namespace)
    return _fetch_arrays(client, m, m.tensors_of_rank(rank), copy, verify)


def load_into(
    client: Client,
    name: str | Manifest,
    buffers: Mapping[str, Any],
    *,
    rank: Optional[int] = None,  # noqa: UP045
    source: Optional[PathLike | Sequence[PathLike]] = None,  # noqa: UP045
    namespace: str = DEFAULT_NAMESPACE,
) -> dict[str, int]:
    """Fills the caller's buffers, ``{tensor name: buffer}``: any writable C-contiguous
    buffer-protocol object (numpy array, bytearray, ...) or contiguous CPU ``torch.Tensor``,
    of exactly the tensor's byte length (its dtype is not checked: bytes are bytes). All in one
    parallel load. Chunks in no copy are read from ``source`` (the published directory, shard
    index or files) when given, and put back. Returns the report: ``chunks_from_pool``,
    ``bytes_from_pool``, ``chunks_from_files``, ``bytes_from_files``, ``chunks_from_replicas``.
    Raises :class:`kvpool.BufferTooSmallError` for a buffer of another size (nothing loaded),
    :class:`kvpool.NotFoundError` for an unknown tensor."""
    m = _require(client, name, namespace)
    tensors = [m.tensor(n, rank) for n in buffers]
    return _load_raw(client, m, tensors, list(buffers.values()), source)


def load_torch(
    client: Client,
    name: str | Manifest,
    *,
    rank: Optional[int] = None,  # noqa: UP045
    namespace: str = DEFAULT_NAMESPACE,
) -> dict[str, torch.Tensor]:
    """Every tensor of model ``name`` as CPU torch tensors of their dtype (``bfloat16`` and
    ``float8`` included) and shape, in file order: each made with ``torch.frombuffer`` over the
    memory it was loaded into (no further copy), writable. Feed it to ``load_state_dict``."""
    m = _require(client, name, namespace)
    tensors = m.tensors_of_rank(rank)
    _check_unique(m, tensors)
    raws = [np.empty(t.nbytes, dtype=np.uint8) for t in tensors]
    _load_raw(client, m, tensors, raws)
    return {t.name: _to_torch(r, t) for t, r in zip(tensors, raws)}


def weight_iterator(
    client: Client,
    name: str | Manifest,
    rank: Optional[int] = 0,  # noqa: UP045
    *,
    group_bytes: int = _GROUP_BYTES,
    copy: bool = False,
    namespace: str = DEFAULT_NAMESPACE,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(tensor name, array)`` in file order, the shape vLLM's and SGLang's
    ``load_weights(Iterable[(name, tensor)])`` consume (``torch.from_numpy`` each, or use
    :func:`load_torch` for ``bfloat16``). The first tensor is fetched alone, so it is ready as
    soon as its chunks arrive; the rest come in groups of up to ``group_bytes``, the next group
    fetched in a background thread while the caller consumes the current one. ``rank``: the
    tensor-parallel rank whose files a per-rank checkpoint loads (every file otherwise).

    As with :func:`load`, arrays are read-only views of the pool's memory on the same host
    (``copy=True`` for writable copies; ``torch.from_numpy`` of a read-only array warns that
    torch can't mark it read-only: the engines' loaders only read it)."""
    m = _require(client, name, namespace)
    tensors = m.tensors_of_rank(rank)
    groups = _groups(tensors, group_bytes, first_alone=True)
    if not groups:
        return

    def fetch(g: list[Tensor]) -> dict[str, np.ndarray]:
        return _fetch_arrays(client, m, g, copy)

    current = fetch(groups[0])
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="kvpool-weights"
    ) as pool:
        nxt: Optional[concurrent.futures.Future] = None  # noqa: UP045
        try:
            for i in range(len(groups)):
                if i + 1 < len(groups):
                    nxt = pool.submit(fetch, groups[i + 1])
                for t in groups[i]:
                    yield t.name, current[t.name]
                current = {}
                if nxt is not None:
                    current = nxt.result()
                    nxt = None
        finally:
            if nxt is not None:
                nxt.cancel()


def get_sharded(
    client: Client,
    name: str | Manifest,
    tensor: str,
    dim: int,
    rank: int,
    world: int,
    *,
    namespace: str = DEFAULT_NAMESPACE,
) -> np.ndarray:
    """Slice ``rank`` of ``world`` of ``tensor`` along dimension ``dim`` (what a
    tensor-parallel rank holds: ``numpy.split(a, world, dim)[rank]``), with the slice's shape.
    Only the chunks the slice touches are fetched. The dimension must divide evenly; raises
    :class:`kvpool.InvalidArgumentError` otherwise."""
    m = _require(client, name, namespace)
    t = m.tensor(tensor)
    if dim < 0:
        dim += len(t.shape)
    if dim < 0 or rank < 0 or world <= 0:
        raise InvalidArgumentError(
            f"bad slice of {tensor!r}: dim {dim}, rank {rank}, world {world}"
        )
    data, shape = _native._weights_slice(
        client, m.namespace, m._native, tensor, dim, rank, world
    )
    raw = np.frombuffer(data, dtype=np.uint8)
    dt = numpy_dtype(t.dtype)
    if dt.itemsize * int(np.prod(shape, dtype=np.int64)) != raw.nbytes:
        return raw
    return raw.view(dt).reshape(shape)


# ----- single flight -----


@dataclass(frozen=True)
class Ensured:
    """What :func:`ensure` did."""

    how: Literal["pool", "published", "restored"]
    """``"pool"``: every chunk came from the pool. ``"restored"``: the model was published but
    some chunks were in no copy; they were read from the files and put back. ``"published"``:
    the model was not in the pool; this process read the files and published them."""
    manifest: Manifest
    """The model's manifest."""
    arrays: Optional[dict[str, np.ndarray]]  # noqa: UP045
    """The tensors (as :func:`load` returns them) when ``load=True``, else None."""
    report: dict[str, int]
    """Where the loaded bytes came from (see :func:`load_into`); all zero when nothing was
    loaded."""


def lock_dir() -> Path:
    """Where :func:`ensure` keeps its lock files: ``$KVPOOL_LOCK_DIR``, else
    ``$XDG_RUNTIME_DIR``, else the system temporary directory."""
    d = os.environ.get("KVPOOL_LOCK_DIR") or os.environ.get("XDG_RUNTIME_DIR")
    return Path(d) if d else Path(tempfile.gettempdir())


def _lock_path(namespace: str, name: str, directory: Optional[PathLike]) -> Path:  # noqa: UP045
    digest = hashlib.sha256(f"{namespace}\0{name}".encode()).hexdigest()[:24]
    return Path(directory or lock_dir()) / f"kvpool-weights-{digest}.lock"


def _empty_report() -> dict[str, int]:
    return dict.fromkeys(
        (
            "chunks_from_pool",
            "bytes_from_pool",
            "chunks_from_files",
            "bytes_from_files",
            "chunks_from_replicas",
        ),
        0,
    )


def ensure(
    client: Client,
    name: str,
    path: PathLike | Sequence[PathLike],
    *,
    load: bool = True,
    rank: Optional[int] = None,  # noqa: UP045
    chunk_size: Optional[int] = None,  # noqa: UP045
    replicas: Optional[int] = None,  # noqa: UP045
    lock_directory: Optional[PathLike] = None,  # noqa: UP045
    namespace: str = DEFAULT_NAMESPACE,
) -> Ensured:
    """Makes sure model ``name`` is in the pool and (``load=True``) returns its tensors.

    - Published: loads it from the pool. Chunks in no copy (evicted, or on a lost node without
      replicas) are read from ``path`` alone and put back (``how="restored"``); the rest still
      come from the pool, so a half-present model costs about half a cold one.
    - Not published: takes a per-model lock file (``fcntl.flock`` on
      ``<lock_directory>/kvpool-weights-<hash of namespace and name>.lock``, :func:`lock_dir`
      by default), looks again, and if it is still absent reads ``path`` (what
      :func:`publish` takes) once and publishes it (``how="published"``). The other processes
      on this host wait on the lock, then find it in the pool: N processes calling ``ensure``
      at once cause one publication and one read of the files.

    Across hosts the lock does not reach: two hosts may both find the model absent and both
    publish it. That is safe (chunk keys are named by the chunks' checksums, so both write the
    same objects, and the last manifest written wins, naming the same chunks) but costs a
    second read of the files. Returns an :class:`Ensured`."""
    m = manifest(client, name, namespace=namespace)
    how: Literal["pool", "published", "restored"] = "pool"
    if m is None:
        lock = _lock_path(namespace, name, lock_directory)
        lock.parent.mkdir(parents=True, exist_ok=True)
        # Read-only suffices for flock, so a lock file another user created works too.
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
        with os.fdopen(fd, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                m = manifest(client, name, namespace=namespace)
                if m is None:
                    m = publish(
                        client,
                        name,
                        path,
                        chunk_size=chunk_size,
                        replicas=replicas,
                        namespace=namespace,
                    )
                    how = "published"
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    if how == "published":
        if not load:
            return Ensured(how, m, None, _empty_report())
        arrays, report = _load_arrays(client, m, m.tensors_of_rank(rank))
        return Ensured(how, m, arrays, report)
    if load:
        arrays, report = _load_arrays(client, m, m.tensors_of_rank(rank), path)
    else:
        # Every chunk is still checked, a group at a time (bounded memory): a missing one is
        # read from the files and put back.
        arrays, report = None, _empty_report()
        for g in _groups(m.tensors, _GROUP_BYTES, first_alone=False):
            r = _load_raw(client, m, g, [np.empty(t.nbytes, np.uint8) for t in g], path)
            for k, v in r.items():
                report[k] += v
    if report["chunks_from_files"]:
        how = "restored"
    return Ensured(how, m, arrays, report)

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
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import numpy as np

from . import _native
from ._errors import BufferTooSmallError, InvalidArgumentError, NotFoundError

_log = logging.getLogger(__name__)

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

DEFAULT_NAMESPACE = "weights"
"""The namespace weights go to unless told otherwise (every node has it)."""

PathLike = Union[str, "os.PathLike[str]"]

# safetensors dtype -> (numpy dtype string, bits per element). Little-endian, as the format is.
_NUMPY: dict[str, str] = {
    "BOOL": "|b1",
    "U8": "|u1",
    "I8": "|i1",
    "U16": "<u2",
    "I16": "<i2",
    "F16": "<f2",
    "U32": "<u4",
    "I32": "<i4",
    "F32": "<f4",
    "U64": "<u8",
    "I64": "<i8",
    "F64": "<f8",
    "C64": "<c8",
}
# dtypes numpy lacks: the ml_dtypes name, and the raw integer type used without it.
_ML_DTYPES: dict[str, tuple[str, str]] = {
    "BF16": ("bfloat16", "<u2"),
    "F8_E4M3": ("float8_e4m3fn", "|u1"),
    "F8_E5M2": ("float8_e5m2", "|u1"),
    "F8_E8M0": ("float8_e8m0fnu", "|u1"),
}
_TORCH: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}

# weight_iterator's groups: the first holds one tensor (ready at once), later ones grow to
# this many bytes while the previous one is consumed.
_GROUP_BYTES = 64 << 20


@dataclass(frozen=True)
class Tensor:
    """One tensor of a published model."""

    name: str
    """Its name in the checkpoint."""
    dtype: str
    """safetensors element type (``F32``, ``BF16``, ...)."""
    shape: tuple[int, ...]
    """Shape."""
    file: int
    """Index of its file in :attr:`Manifest.files`."""
    index: int
    """Index in its file (the order of its bytes)."""
    nbytes: int
    """Length in bytes."""


@dataclass(frozen=True)
class File:
    """One safetensors file of a published model."""

    name: str
    """Its name, relative to the directory that was published."""
    rank: Optional[int]  # noqa: UP045 (evaluated by dataclasses on Python 3.9)
    """The tensor-parallel rank of a per-rank checkpoint (``*-rank-R-*``), None: every rank's."""
    tensors: tuple[Tensor, ...]
    """Its tensors, in the order of their bytes."""


@dataclass(frozen=True)
class ExtraFile:
    """A companion file (``config.json``, tokenizer, shard index) stored whole."""

    name: str
    """Its name, relative to the directory that was published."""
    nbytes: int
    """Length."""
    index: int
    """Index in :attr:`Manifest.extra`."""


@dataclass(frozen=True)
class Manifest:
    """What the pool holds of a published model: a view of its manifest (docs/WEIGHTS.md)."""

    name: str
    """The model's name."""
    chunk_size: int
    """Largest chunk a tensor was cut into."""
    replicas: int
    """Copies of each piece the namespace kept when it was published."""
    files: tuple[File, ...]
    """The safetensors files, in order."""
    extra: tuple[ExtraFile, ...]
    """The companion files."""
    namespace: str = DEFAULT_NAMESPACE
    """The namespace it lives in."""
    _native: Any = field(default=None, repr=False, compare=False)

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor, file by file, in the order of their bytes (the checkpoint's order)."""
        return [t for f in self.files for t in f.tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str, rank: Optional[int] = None) -> Tensor:  # noqa: UP045
        """The tensor called ``name`` (of ``rank``'s files in a per-rank checkpoint). Raises
        :class:`kvpool.NotFoundError`."""
        for f in self.files:
            if rank is not None and f.rank is not None and f.rank != rank:
                continue
            for t in f.tensors:
                if t.name == name:
                    return t
        raise NotFoundError(f"model {self.name!r} has no tensor {name!r}")

    def tensors_of_rank(self, rank: Optional[int]) -> list[Tensor]:  # noqa: UP045
        """The tensors tensor-parallel ``rank`` loads: its own files' and those of every rank
        (all of them for ``None``)."""
        return [
            t
            for f in self.files
            if rank is None or f.rank is None or f.rank == rank
            for t in f.tensors
        ]

    def chunk_keys(self) -> list[tuple[int, int, int, bytes]]:
        """(file index, tensor index, chunk index, key) of every chunk: the objects the model's
        tensors are stored as, in :attr:`namespace`."""
        return self._native.chunk_keys()

    def json(self) -> str:
        """The manifest's JSON, as stored in the pool."""
        return self._native.json()


def _view(model: Any, namespace: str) -> Manifest:
    m = json.loads(model.json())
    files = tuple(
        File(
            name=f["name"],
            rank=f["rank"],
            tensors=tuple(
                Tensor(
                    name=t["name"],
                    dtype=t["dtype"],
                    shape=tuple(t["shape"]),
                    file=fi,
                    index=ti,
                    nbytes=t["len"],
                )
                for ti, t in enumerate(f["tensors"])
            ),
        )
        for fi, f in enumerate(m["files"])
    )
    extra = tuple(
        ExtraFile(name=e["name"], nbytes=e["len"], index=i)
        for i, e in enumerate(m["extra"])
    )
    return Manifest(
        name=m["name"],
        chunk_size=m["chunk_size"],
        replicas=m["replicas"],
        files=files,
        extra=extra,
        namespace=namespace,
        _native=model,
    )


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype. ``BF16`` and the ``F8_*`` types have none in
    numpy: with ``ml_dtypes`` importable they are its ``bfloat16``/``float8_*`` types, without
    it the raw bits as ``uint16`` (``BF16``) or ``uint8`` (``F8_*``). Sub-byte types (``F4``,
    ``F6_*``) and unknown ones are ``uint8`` (their raw bytes)."""
    if dtype in _NUMPY:
        return np.dtype(_NUMPY[dtype])
    if dtype in _ML_DTYPES:
        ml_name, raw = _ML_DTYPES[dtype]
        try:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, ml_name))
        except (ImportError, AttributeError):
            return np.dtype(raw)
    return np.dtype("|u1")


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype (``BF16`` is ``torch.bfloat16``). Raises
    :class:`kvpool.InvalidArgumentError` for one torch lacks (sub-byte types)."""
    import torch

    name = _TORCH.get(dtype)
    if name is None or not hasattr(torch, name):
        raise InvalidArgumentError(f"torch has no dtype for safetensors {dtype}")
    return getattr(torch, name)


def _shaped(raw: np.ndarray, t: Tensor) -> np.ndarray:
    """The raw bytes of ``t`` as an array of its dtype and shape (a view, no copy)."""
    dt = numpy_dtype(t.dtype)
    if dt.itemsize * int(np.prod(t.shape, dtype=np.int64)) != t.nbytes:
        return raw  # a sub-byte type: its bytes as they are
    return raw.view(dt).reshape(t.shape)


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


# ----- loading -----


def _sources(source: Any) -> tuple[Optional[str], Optional[list[str]]]:  # noqa: UP045
    """(source_dir, source_files) of the native load for ``source``: a directory (files named
    as published under it), a shard index (its directory), a file, or a list of files."""
    if source is None:
        return None, None
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            return os.fspath(p), None
        if p.name.endswith(".index.json"):
            return os.fspath(p.parent), None
        return None, [os.fspath(p)]
    paths = [Path(s) for s in source]
    if len(paths) == 1 and paths[0].is_dir():
        return os.fspath(paths[0]), None
    for p in paths:
        if p.name.endswith(".index.json"):
            return os.fspath(p.parent), None
    return None, [os.fspath(p) for p in paths]


def _byte_view(buf: Any) -> memoryview:
    """A writable, C-contiguous byte view of a buffer-protocol object or a CPU torch tensor
    (through a numpy view of the same memory)."""
    if type(buf).__module__.startswith("torch"):
        import torch

        if not isinstance(buf, torch.Tensor):
            raise InvalidArgumentError(f"{type(buf).__name__} is not a tensor")
        if buf.device.type != "cpu":
            raise InvalidArgumentError(
                f"a tensor on {buf.device} can't be filled in place: load into a CPU tensor "
                "and copy it over"
            )
        if not buf.is_contiguous():
            raise InvalidArgumentError("the tensor must be contiguous")
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidArgumentError(
            f"{type(buf).__name__} does not support the buffer protocol"
        ) from None
    if mv.readonly:
        raise InvalidArgumentError(
            "a load needs a writable buffer; this one is read-only"
        )
    if not mv.c_contiguous:
        raise InvalidArgumentError("the buffer must be C-contiguous")
    return mv


def _load_raw(
    client: Client,
    m: Manifest,
    tensors: Sequence[Tensor],
    bufs: Sequence[Any],
    source: Any = None,
) -> dict[str, int]:
    """Loads ``tensors[i]`` into ``bufs[i]`` (writable buffers of exactly its length) in one
    parallel load; returns its report."""
    targets = []
    holders = []
    for t, b in zip(tensors, bufs):
        mv = _byte_view(b)
        if mv.nbytes != t.nbytes:
            raise BufferTooSmallError(
                f"buffer for {t.name!r} is {mv.nbytes} bytes, the tensor {t.nbytes}"
            )
        if mv.nbytes == 0:
            targets.append((t.file, t.index, 0, 0))
            holders.append(mv)
            continue
        # Exports the buffer until `holders` is dropped: it can't be freed or resized while
        # the native load writes into it.
        h = (ctypes.c_char * mv.nbytes).from_buffer(mv)
        holders.append(h)
        targets.append((t.file, t.index, ctypes.addressof(h), mv.nbytes))
    source_dir, source_files = _sources(source)
    try:
        return _native._weights_load_into_unchecked(
            client, m.namespace, m._native, targets, source_dir, source_files
        )
    finally:
        del holders


def _check_unique(m: Manifest, tensors: Sequence[Tensor]) -> None:
    """Refuses to key tensors by name when names repeat (a per-rank checkpoint's files loaded
    for every rank at once)."""
    if len({t.name for t in tensors}) != len(tensors):
        raise InvalidArgumentError(
            f"tensor names of model {m.name!r} repeat across its per-rank files: pass rank="
        )


def _load_arrays(
    client: Client, m: Manifest, tensors: Sequence[Tensor], source: Any = None
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    _check_unique(m, tensors)
    raws = [np.empty(t.nbytes, dtype=np.uint8) for t in tensors]
    report = _load_raw(client, m, tensors, raws, source)
    return {t.name: _shaped(r, t) for t, r in zip(tensors, raws)}, report


class _PoolRegion:
    """Bytes of the pool mapped into this process, for ``numpy.asarray``: an array made from
    it keeps it (its ``base``), and it keeps the owner of the mapping and of the holds alive."""

    __slots__ = ("__array_interface__", "_owner")

    def __init__(self, owner: Any, address: int, length: int) -> None:
        self._owner = owner
        self.__array_interface__ = {
            "version": 3,
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, True),  # read-only
        }


def _view_arrays(
    client: Client, m: Manifest, tensors: Sequence[Tensor], verify: bool
) -> tuple[dict[str, np.ndarray], list[Tensor]]:
    """Read-only arrays over the pool's own memory for the tensors whose chunks all have a
    copy on this host (checked against the manifest once, while they are made), and the
    tensors left to copy. Nothing is viewed (everything left to copy) when the views can't be
    made at all: another host, a daemon without holds, a view of more chunks than a
    connection may hold."""
    try:
        owner, places = _native._weights_view(
            client,
            m.namespace,
            m._native,
            [(t.file, t.index) for t in tensors],
            verify,
        )
    except Exception as e:  # noqa: BLE001 - any failure to view falls back to a copy
        _log.debug("zero-copy views of %r not made (%s); copying", m.name, e)
        return {}, list(tensors)
    viewed: dict[str, np.ndarray] = {}
    rest: list[Tensor] = []
    for t, place in zip(tensors, places):
        if place is None:
            rest.append(t)
            continue
        raw = np.asarray(_PoolRegion(owner, place[0], place[1]))
        viewed[t.name] = _shaped(raw, t)
    return viewed, rest


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


def _fetch_arrays(
    client: Client,
    m: Manifest,
    tensors: Sequence[Tensor],
    copy: bool,
    verify: bool = True,
) -> dict[str, np.ndarray]:
    """``tensors`` by name in their order: views where they can be made (unless ``copy``),
    verified copies for the rest."""
    _check_unique(m, tensors)
    if copy:
        viewed, rest = {}, list(tensors)
    else:
        viewed, rest = _view_arrays(client, m, tensors, verify)
    copied = _load_arrays(client, m, rest)[0] if rest else {}
    return {
        t.name: viewed[t.name] if t.name in viewed else copied[t.name] for t in tensors
    }


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


def _to_torch(raw: np.ndarray, t: Tensor) -> torch.Tensor:
    import torch

    dt = torch_dtype(t.dtype)
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dt)
    return torch.frombuffer(raw, dtype=dt).reshape(t.shape)


def _groups(
    tensors: Sequence[Tensor], group_bytes: int, *, first_alone: bool
) -> list[list[Tensor]]:
    """``tensors`` in order, cut into runs of at most ``group_bytes`` (a larger tensor is a
    run of its own); with ``first_alone`` the first tensor is a run of its own."""
    groups: list[list[Tensor]] = []
    size = 0
    for i, t in enumerate(tensors):
        if not groups or (first_alone and i == 1) or size + t.nbytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


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

"""How model weights are loaded: into the caller's buffers through one parallel native load,
as read-only views of the pool's own memory on its host, and in groups for an iterator."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from . import _native
from ._errors import BufferTooSmallError, InvalidArgumentError
from ._weights_manifest import Manifest, Tensor, _shaped, torch_dtype

if TYPE_CHECKING:
    import torch

    from . import Client

_log = logging.getLogger("kvpool.weights")

# this many bytes while the previous one is consumed.
_GROUP_BYTES = 64 << 20


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

"""What the pool holds of a published model, as Python sees it: the manifest's files, tensors and
companion files, and the numpy and torch dtypes of safetensors' element types."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ._errors import InvalidArgumentError, NotFoundError

if TYPE_CHECKING:
    import torch

DEFAULT_NAMESPACE = "weights"
"""The namespace weights go to unless told otherwise (every node has it)."""

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

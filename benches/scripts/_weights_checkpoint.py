"""The checkpoint ``weights_bench.py`` measures: a Llama-style bf16 decoder shaped as
``kvpool-bench weights`` shapes it (benches/src/weights/model.rs), written as one safetensors
file of pseudo-random bytes, and the file read back as ``safetensors.numpy.load_file`` reads
it."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

NAME = "bench-model"
MIN_VOCAB = 32_000
MIN_LAYERS = 16
BF16 = 2


def parse_size(text: str) -> int:
    """``2GiB``, ``64MiB``, ``512KiB`` or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*(|B|KiB|MiB|GiB)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 2GiB, 64MiB)")
    unit = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
    return int(m.group(1)) * unit


class Shape:
    """A Llama-style bf16 decoder: hidden, MLP width, layers, vocabulary."""

    def __init__(self, hidden: int, intermediate: int, layers: int, vocab: int):
        self.hidden, self.intermediate = hidden, intermediate
        self.layers, self.vocab = layers, vocab

    def layer_bytes(self) -> int:
        h, i = self.hidden, self.intermediate
        return BF16 * (2 * h + 2 * h * h + 2 * (h // 4) * h + 3 * i * h)

    def bytes(self) -> int:
        return (
            BF16 * (2 * self.vocab * self.hidden + self.hidden)
            + self.layers * self.layer_bytes()
        )

    @staticmethod
    def for_size(size: int) -> Shape:
        """The shape whose file is closest to ``size`` without exceeding it (as
        ``ModelShape::for_size``): the largest hidden size leaving room for 16 layers."""
        for hidden in (8192, 4096, 2048, 1024, 512, 256, 128):
            inter = -(-(hidden * 11 // 4) // 128) * 128
            s = Shape(hidden, inter, 0, MIN_VOCAB)
            fixed = s.bytes()
            if size < fixed:
                continue
            s.layers = (size - fixed) // s.layer_bytes()
            if s.layers < MIN_LAYERS and hidden > 128:
                continue
            if s.layers == 0:
                break
            rest = size - s.bytes() + 2 * MIN_VOCAB * hidden * BF16
            s.vocab = (rest // (2 * hidden * BF16)) // 64 * 64
            return s
        raise SystemExit(f"--size {size} is too small for a model")

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in name order (the order of their bytes)."""
        h, i, kv = self.hidden, self.intermediate, self.hidden // 4
        out = [
            ("lm_head.weight", (self.vocab, h)),
            ("model.embed_tokens.weight", (self.vocab, h)),
            ("model.norm.weight", (h,)),
        ]
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
            ]
        return sorted(out)

    def describe(self) -> str:
        return (
            f"Llama-style bf16: hidden {self.hidden}, MLP {self.intermediate}, "
            f"{self.layers} layers, vocabulary {self.vocab}, {len(self.tensors())} tensors, "
            f"{self.bytes() / (1 << 30):.2f} GiB"
        )


class Checkpoint:
    """The generated file: its path and where each tensor's bytes lie in it."""

    def __init__(
        self, path: Path, tensors: list[tuple[str, tuple[int, ...], int, int]]
    ):
        self.path = path
        self.tensors = tensors  # (name, shape, offset in the file, length), file order
        self.nbytes = sum(t[3] for t in tensors)
        self._mm: Optional[np.memmap] = None  # noqa: UP045

    @property
    def mm(self) -> np.memmap:
        """The file mapped read-only (the page cache's copy: no second copy in memory)."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def spans(self) -> dict[str, tuple[int, int]]:
        return {n: (off, ln) for n, _, off, ln in self.tensors}

    def same(self, name: str, data: Any, spans: dict[str, tuple[int, int]]) -> bool:
        """Whether ``data`` (numpy array or CPU torch tensor) holds tensor ``name``'s bytes."""
        off, ln = spans[name]
        if type(data).__module__.startswith("torch"):
            import torch

            data = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return raw.nbytes == ln and np.array_equal(raw, self.mm[off : off + ln])

    def check_all(self, got: dict[str, Any] | list[tuple[str, Any]], what: str) -> None:
        """Raises unless ``got`` holds every tensor, in file order, byte for byte."""
        items = list(got.items()) if isinstance(got, dict) else list(got)
        names = [n for n, _ in items]
        want = [t[0] for t in self.tensors]
        if names != want:
            raise RuntimeError(
                f"{what}: tensors {names[:3]}... are not the file's {want[:3]}..."
            )
        spans = self.spans()
        for n, a in items:
            if not self.same(n, a, spans):
                raise RuntimeError(f"{what}: tensor {n} differs from the file")


def write_checkpoint(shape: Shape, path: Path) -> Checkpoint:
    """Writes ``shape`` as one safetensors file (header padded so the data starts 8-byte
    aligned, as the safetensors writer does), pseudo-random bytes."""
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "generator": "weights_bench.py"}
    }
    at = 0
    spans = []
    for name, shp in shape.tensors():
        n = int(np.prod(shp)) * BF16
        header[name] = {
            "dtype": "BF16",
            "shape": list(shp),
            "data_offsets": [at, at + n],
        }
        spans.append((name, shp, at, n))
        at += n
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((-(8 + len(text))) % 8)
    start = 8 + len(text)
    rng = np.random.default_rng(0x9E3779B97F4A7C15)
    block = 16 << 20
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text.encode())
        left = at
        while left > 0:
            n = min(left, block)
            words = rng.integers(0, 2**63, size=(n + 7) // 8, dtype=np.uint64)
            f.write(words.view(np.uint8)[:n].tobytes())
            left -= n
    return Checkpoint(path, [(n, s, start + off, ln) for n, s, off, ln in spans])


def read_file(path: str) -> dict[str, np.ndarray]:
    """What ``safetensors.numpy.load_file`` does for dtypes numpy has (it refuses ``BF16``
    without ml_dtypes): the file read into memory, an array per tensor over it, file order."""
    with open(path, "rb", buffering=0) as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        buf = np.empty(os.fstat(f.fileno()).st_size - 8 - n, dtype=np.uint8)
        f.readinto(memoryview(buf))
    header.pop("__metadata__", None)
    return {
        k: buf[v["data_offsets"][0] : v["data_offsets"][1]]
        .view("<u2")
        .reshape(v["shape"])
        for k, v in sorted(header.items(), key=lambda kv_: kv_[1]["data_offsets"][0])
    }

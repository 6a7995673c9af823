"""SGLang's remote model loader (``--load-format remote`` with ``redis://host:port/<model>``)
against kvpoold's RESP door, reading a model published by ``kvpool weights put``, for real.

The model is a small safetensors file of several dtypes (bf16, f16, f32, i64; one tensor cut
into several chunks) and a ``config.json``. It is published with the CLI into the ``weights``
namespace; SGLang's own ``RedisConnector`` then lists and reads it through the door's weights
view (docs/WEIGHTS.md), and SGLang's own ``RemoteModelLoader._load_model_from_remote_kv`` loads
it into a torch module. The only thing patched is the loader's ``get_parallel`` (which needs a
distributed group), to answer tensor-parallel rank 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest
from conftest import REPO, in_ci, require

try:
    import redis
    import torch
    from safetensors.torch import save_file
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.connector.redis import RedisConnector
    from sglang.srt.model_loader import loader as sglang_loader
except ImportError as e:  # the engines venv is missing (scripts/python-env builds it)
    if in_ci():
        raise
    pytest.skip(f"SGLang is not installed: {e}", allow_module_level=True)

MODEL = "org/tiny-model"
CHUNK = "4KiB"
# Not ASCII, so "byte for byte" means something.
CONFIG = '{"architectures": ["Tiny"], "hidden_size": 8, "note": "café ✓"}\n'


class Tiny(torch.nn.Module):
    """A module whose state dict names are the published tensors'."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float16)
        self.big = torch.nn.Parameter(torch.zeros(64, 40))  # f32, 10 KiB: three chunks
        self.register_buffer("positions", torch.zeros(5, dtype=torch.int64))


def original() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(15)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "proj.weight": torch.randn(8, 8, generator=g).to(torch.float16),
        "proj.bias": torch.randn(8, generator=g).to(torch.float16),
        "big": torch.randn(64, 40, generator=g),
        "positions": torch.arange(5, dtype=torch.int64) * 7,
    }


def kvpool_cli() -> Path:
    """The CLI that publishes: ``$KVPOOL_CLI`` or the workspace's debug build."""
    p = Path(os.environ.get("KVPOOL_CLI", REPO / "target" / "debug" / "kvpool"))
    require(p.exists(), f"the kvpool CLI ({p})", "cargo build -p kvpool-cli")
    return p


def publish(daemon, files: list[Path], token: str | None = None) -> None:
    cmd = [
        str(kvpool_cli()),
        "-e",
        daemon.url,
        "weights",
        "put",
        MODEL,
        "--chunk-size",
        CHUNK,
    ]
    cmd += [str(f) for f in files]
    env = dict(os.environ, KVPOOL_TOKEN=token or "")
    r = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr


@pytest.fixture
def published(start_kvpoold, tmp_path):
    """A daemon with its RESP door and the tiny model published: ``(daemon, redis URL)``."""
    d = start_kvpoold(memory="128MiB", extra=["--resp", "127.0.0.1:0"])
    save_file(original(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_bytes(CONFIG.encode())
    publish(d, [tmp_path / "model.safetensors", tmp_path / "config.json"])
    return d, f"redis://{d.addr('resp')}/{MODEL}"


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    )


def test_weight_iterator_yields_every_tensor_as_published(published):
    _, url = published
    c = RedisConnector(url)
    try:
        got = dict(c.weight_iterator(0))
    finally:
        c.close()
    want = original()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert same(got[name], t), name


def test_pull_files_recreates_the_config_byte_for_byte(published):
    _, url = published
    c = RedisConnector(url)
    try:
        c.pull_files()
        pulled = Path(c.get_local_dir()) / "config.json"
        assert pulled.read_bytes() == CONFIG.encode()
    finally:
        c.close()


def test_sglangs_remote_loader_fills_a_module(published, monkeypatch):
    _, url = published
    # The loader asks the distributed runtime for its tensor-parallel rank: rank 0 of 1.
    monkeypatch.setattr(
        sglang_loader,
        "get_parallel",
        lambda: types.SimpleNamespace(tp_rank=0, tp_size=1),
    )
    loader = sglang_loader.RemoteModelLoader(LoadConfig(load_format=LoadFormat.REMOTE))
    model = Tiny()
    c = RedisConnector(url)
    try:
        loader._load_model_from_remote_kv(model, None, c)
    finally:
        c.close()
    state = model.state_dict()
    for name, t in original().items():
        assert same(state[name], t), name


def test_a_chunk_failing_its_checksum_makes_the_get_a_miss(published):
    d, url = published
    host, port = d.addr("resp").split(":")
    # A connection in the weights namespace itself (the node has no token: any token admits)
    # overwrites one chunk of "big" with other bytes of the same length.
    w = redis.Redis(host=host, port=int(port))
    w.execute_command("AUTH", "weights", "any")
    manifest = json.loads(w.get(f"manifest/{MODEL}"))
    [fi] = [
        i for i, f in enumerate(manifest["files"]) if f["name"] == "model.safetensors"
    ]
    tensors = manifest["files"][fi]["tensors"]
    [ti] = [i for i, t in enumerate(tensors) if t["name"] == "big"]
    assert len(tensors[ti]["chunks"]) == 3
    pattern = f"w/*/{fi}.{ti}.1/{tensors[ti]['chunks'][1]:016x}"
    keys = list(w.scan_iter(match=pattern, count=10_000))
    assert len(keys) == 1, keys
    good = w.get(keys[0])
    w.set(keys[0], bytes(b ^ 1 for b in good))

    r = redis.Redis(host=host, port=int(port))
    assert r.get(f"{MODEL}/keys/rank_0/big") is None
    # The other tensors are still served, and the chunk restored serves "big" again.
    assert r.get(f"{MODEL}/keys/rank_0/proj.bias") is not None
    w.set(keys[0], good)
    c = RedisConnector(url)
    try:
        assert same(c.get(f"{MODEL}/keys/rank_0/big"), original()["big"])
    finally:
        c.close()
    # A chunk of the wrong length is a miss too.
    w.set(keys[0], good[:-4])
    assert r.get(f"{MODEL}/keys/rank_0/big") is None


def test_scan_lists_the_view_and_writes_stay_ordinary_keys(published):
    d, _ = published
    host, port = d.addr("resp").split(":")
    r = redis.Redis(host=host, port=int(port))
    cursor, keys = r.scan(0, match=f"{MODEL}/keys/rank_0/proj.*")
    assert cursor == 0
    assert sorted(keys) == [
        f"{MODEL}/keys/rank_0/proj.bias".encode(),
        f"{MODEL}/keys/rank_0/proj.weight".encode(),
    ]
    assert r.scan(0, match=f"{MODEL}/files/*") == (
        0,
        [f"{MODEL}/files/config.json".encode()],
    )
    # A rank of a checkpoint not saved per rank reads every tensor.
    assert len(r.scan(0, match=f"{MODEL}/keys/rank_3/*")[1]) == len(original())
    # A SET of a view name stores an ordinary key of the connection's namespace: the view
    # still answers GET while the model is published, and the weights are untouched.
    name = f"{MODEL}/keys/rank_0/proj.bias"
    assert r.set(name, b"not a tensor")
    assert r.get(name) != b"not a tensor"
    assert r.delete(name) == 1
    assert r.get(name) is not None


def test_a_client_the_weights_namespace_does_not_admit_sees_no_view(
    start_kvpoold, tmp_path
):
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text('[[namespace]]\nname = "weights"\ntokens = ["weights-token"]\n')
    d = start_kvpoold(
        memory="128MiB", extra=["--resp", "127.0.0.1:0", "--config", str(cfg)]
    )
    save_file(original(), tmp_path / "model.safetensors")
    publish(d, [tmp_path / "model.safetensors"], token="weights-token")
    host, port = d.addr("resp").split(":")
    name = f"{MODEL}/keys/rank_0/proj.bias"
    # The node has no token: a connection starts in `default`, which does not admit to weights.
    r = redis.Redis(host=host, port=int(port))
    assert r.get(name) is None
    assert r.scan(0, match=f"{MODEL}/keys/rank_0/*")[1] == []
    # With the weights namespace's token (still in `default`), the view is there.
    r.execute_command("AUTH", "default", "weights-token")
    assert r.scan(0, match=f"{MODEL}/keys/rank_0/*")[1] != []
    assert r.get(name) is not None

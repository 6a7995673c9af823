"""kvpoold's RESP front door (``--resp``) driven by real Redis clients: redis-py 8 over RESP2 and
RESP3, redis-cli, redis-benchmark, and the exact command sequences of LMCache's ``redis://`` and
``resp://`` connectors and of SGLang's remote weight loader."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import shutil
import socket
import subprocess
import threading

import pytest
from conftest import require, require_module

PROTOCOLS = [2, 3]
TOKENS_CONFIG = """
[auth]
token = "node-token"

[[namespace]]
name = "alpha"
tokens = ["alpha-token"]

[[namespace]]
name = "beta"
tokens = ["beta-token"]
"""


def redis_module():
    return require_module("redis", 'pip install "redis>=8"')


def host_port(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


@pytest.fixture
def resp(start_kvpoold):
    """A daemon with the RESP door on a free port; yields ``(daemon, host, port)``."""
    d = start_kvpoold(memory="512MiB", extra=["--resp", "127.0.0.1:0"])
    host, port = host_port(d.addr("resp"))
    return d, host, port


@pytest.fixture
def tokens(start_kvpoold, tmp_path):
    """A daemon whose namespaces ``alpha`` and ``beta`` each need their own token."""
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text(TOKENS_CONFIG)
    d = start_kvpoold(
        memory="64MiB", extra=["--config", str(cfg), "--resp", "127.0.0.1:0"]
    )
    host, port = host_port(d.addr("resp"))
    return d, host, port


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pipeline_of_1000_commands(resp, protocol):
    redis = redis_module()
    _, host, port = resp
    r = redis.Redis(host=host, port=port, protocol=protocol, socket_timeout=30)
    p = r.pipeline(transaction=False)
    for i in range(500):
        p.set(f"key:{i}", f"value:{i}".encode() * 8)
    for i in range(500):
        p.get(f"key:{i}")
    out = p.execute()
    assert len(out) == 1000
    assert all(x is True for x in out[:500])
    assert out[500:] == [f"value:{i}".encode() * 8 for i in range(500)]
    assert r.dbsize() == 500
    r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_binary_keys_values_and_mget_with_misses(resp, protocol):
    redis = redis_module()
    _, host, port = resp
    r = redis.Redis(host=host, port=port, protocol=protocol, socket_timeout=30)
    key = b"bin\r\nkey\x00\xff*3\r\n$3\r\n"
    value = b"\r\n$-1\r\n\x00" + bytes(range(256)) + b"\r\n"
    assert r.set(key, value)
    assert r.get(key) == value
    assert r.strlen(key) == len(value)
    assert r.exists(key, b"missing", key) == 2
    assert r.mget([key, b"missing", b"also-missing"]) == [value, None, None]
    assert r.get(b"missing") is None
    assert r.delete(key, b"missing") == 1
    assert r.unlink(key) == 0
    assert r.ping()
    assert r.echo(b"a\r\nb") == b"a\r\nb"
    r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_64_mib_value(resp, protocol):
    redis = redis_module()
    _, host, port = resp
    r = redis.Redis(host=host, port=port, protocol=protocol, socket_timeout=60)
    big = os.urandom(64 << 20)
    assert r.set("big", big)
    got = r.get("big")
    assert got is not None and len(got) == len(big) and got == big
    r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_auth_to_two_namespaces_that_cannot_see_each_other(tokens, protocol):
    redis = redis_module()
    _, host, port = tokens
    a = redis.Redis(
        host=host,
        port=port,
        protocol=protocol,
        username="alpha",
        password="alpha-token",
    )
    b = redis.Redis(
        host=host, port=port, protocol=protocol, username="beta", password="beta-token"
    )
    assert a.set("shared-name", b"alpha's")
    assert b.get("shared-name") is None
    assert b.set("shared-name", b"beta's")
    assert a.get("shared-name") == b"alpha's"
    assert b.get("shared-name") == b"beta's"
    assert [k for k in a.scan_iter()] == [b"shared-name"]
    assert a.dbsize() == 1 and b.dbsize() == 1
    # A namespace's token does not open another namespace; no token opens nothing. (No
    # retries: redis-py retries a failed connection, with backoff, by default.)
    once = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(
            host=host,
            port=port,
            protocol=protocol,
            username="beta",
            password="alpha-token",
            retry=once,
        ).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=host, port=port, protocol=protocol, retry=once).get(
            "shared-name"
        )
    # The node token opens any namespace; AUTH <token> alone means `default`.
    admin = redis.Redis(
        host=host, port=port, protocol=protocol, username="beta", password="node-token"
    )
    assert admin.get("shared-name") == b"beta's"
    default = redis.Redis(
        host=host, port=port, protocol=protocol, password="node-token"
    )
    assert default.get("shared-name") is None
    # FLUSHDB (and FLUSHALL) empty the connection's namespace only.
    assert a.set("second", b"x")
    assert a.flushdb() and a.dbsize() == 0 and a.get("shared-name") is None
    assert b.get("shared-name") == b"beta's"
    assert b.flushall(asynchronous=True) and b.dbsize() == 0
    for c in (a, b, admin, default):
        c.close()


def test_set_nx_has_one_winner_among_racing_clients(resp):
    redis = redis_module()
    _, host, port = resp
    rounds, threads = 50, 8
    won = [[False] * threads for _ in range(rounds)]
    start = threading.Barrier(threads)

    def race(t: int) -> None:
        r = redis.Redis(host=host, port=port)
        start.wait(timeout=30)
        for i in range(rounds):
            won[i][t] = bool(r.set(f"race-{i}", f"thread-{t}", nx=True))
        r.close()

    ts = [threading.Thread(target=race, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    r = redis.Redis(host=host, port=port)
    for i in range(rounds):
        winners = [t for t in range(threads) if won[i][t]]
        assert len(winners) == 1, f"round {i}: {winners}"
        assert r.get(f"race-{i}") == f"thread-{winners[0]}".encode()
    # XX writes only over an existing key.
    assert r.set("absent-xx", b"1", xx=True) is None and r.get("absent-xx") is None
    assert r.set("race-0", b"over", xx=True) and r.get("race-0") == b"over"
    r.close()


def test_mset_is_all_or_nothing(start_kvpoold):
    redis = redis_module()
    d = start_kvpoold(memory="32MiB", extra=["--resp", "127.0.0.1:0"])
    host, port = host_port(d.addr("resp"))
    r = redis.Redis(host=host, port=port)
    big = os.urandom(12 << 20)
    # Three 12 MiB values can't all be in a 32 MiB pool at once: none is stored.
    with pytest.raises(redis.exceptions.ResponseError):
        r.mset({"m1": big, "m2": big, "m3": big})
    assert r.exists("m1", "m2", "m3") == 0 and r.dbsize() == 0
    # Two fit, and both are there after it.
    assert r.mset({"m1": big, "m2": big[::-1]})
    assert r.get("m1") == big and r.get("m2") == big[::-1]
    r.close()


def test_redis_cli_binary_file_info_dbsize(resp, tmp_path):
    cli = shutil.which("redis-cli")
    require(cli is not None, "redis-cli", "apt-get install redis-tools")
    _, host, port = resp
    data = os.urandom(1 << 20)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    base = [cli, "-h", host, "-p", str(port)]
    with src.open("rb") as f:
        out = subprocess.run(
            base + ["-x", "SET", "blob"],
            stdin=f,
            capture_output=True,
            timeout=30,
            check=False,
        )
    assert out.returncode == 0 and out.stdout.strip() == b"OK", out
    got = subprocess.run(
        base + ["--raw", "GET", "blob"], capture_output=True, timeout=30, check=False
    )
    # --raw prints the value's bytes and a newline.
    assert got.returncode == 0 and got.stdout[:-1] == data
    info = subprocess.run(base + ["INFO"], capture_output=True, timeout=30, check=False)
    assert b"redis_version:" in info.stdout and b"db0:keys=1" in info.stdout, info
    size = subprocess.run(
        base + ["DBSIZE"], capture_output=True, timeout=30, check=False
    )
    assert size.stdout.strip() == b"1", size
    three = subprocess.run(
        base + ["-3", "--raw", "GET", "blob"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert three.stdout[:-1] == data


def test_redis_benchmark_runs_without_errors(resp):
    bench = shutil.which("redis-benchmark")
    require(bench is not None, "redis-benchmark", "apt-get install redis-tools")
    _, host, port = resp
    out = subprocess.run(
        [bench, "-h", host, "-p", str(port), "-t", "set,get,mset"]
        + ["-P", "16", "-d", "4096", "-n", "4000", "-c", "8", "--csv"],
        capture_output=True,
        timeout=300,
        check=False,
    )
    text = out.stdout.decode()
    assert out.returncode == 0, (text, out.stderr)
    assert "rror" not in text + out.stderr.decode(), (text, out.stderr)
    rows = {row[0]: row for row in csv.reader(io.StringIO(text)) if row}
    for test in ("SET", "GET", "MSET (10 keys)"):
        assert test in rows, rows
        assert float(rows[test][1]) > 0


def test_lmcache_redis_connector_sequence(resp):
    """What lmcache/v1/storage_backend/connector/redis_connector.py sends through
    redis.asyncio: EXISTS <key>metadata, SET <key>kv_bytes, SET <key>metadata, GET both, and
    DEL <key>metadata when the bytes went missing."""
    redis = redis_module()
    import redis.asyncio as aredis

    _, host, port = resp

    async def run() -> None:
        pool = aredis.ConnectionPool.from_url(
            f"redis://{host}:{port}", max_connections=150
        )
        conn = aredis.Redis.from_pool(pool)
        keys = [f"vllm@1@0@{i:016x}@bfloat16" for i in range(32)]
        kv = {k: os.urandom(256 << 10) for k in keys}
        meta = {k: f"meta:{k}".encode() for k in keys}
        assert not await conn.exists(keys[0] + "metadata")

        async def put(k: str) -> None:
            await conn.set(k + "kv_bytes", kv[k])
            await conn.set(k + "metadata", meta[k])

        await asyncio.gather(*(put(k) for k in keys))
        for k in keys:
            assert await conn.exists(k + "metadata")
        got = await asyncio.gather(
            *(conn.get(k + "metadata") for k in keys),
            *(conn.get(k + "kv_bytes") for k in keys),
        )
        assert got[: len(keys)] == [meta[k] for k in keys]
        assert got[len(keys) :] == [kv[k] for k in keys]
        assert await conn.delete(keys[0] + "metadata") == 1
        assert await conn.get(keys[0] + "metadata") is None
        await conn.aclose()

    asyncio.run(run())
    assert redis.__version__


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


def test_lmcache_resp_native_client_bytes(tokens):
    """LMCache's native resp:// client (csrc/storage_backends/redis): AUTH user pass when it has
    a password, then one request in flight, replies compared byte for byte."""
    _, host, port = tokens
    s = socket.create_connection((host, port), timeout=10)

    def bulk(b: bytes) -> bytes:
        return b"$%d\r\n%s\r\n" % (len(b), b)

    s.sendall(b"*3\r\n$4\r\nAUTH\r\n" + bulk(b"alpha") + bulk(b"alpha-token"))
    assert recv_exact(s, 5) == b"+OK\r\n"
    key = b"model@1@0@00ff@half"
    chunk = os.urandom(1 << 20)
    s.sendall(b"*3\r\n$3\r\nSET\r\n" + bulk(key) + bulk(chunk))
    assert recv_exact(s, 5) == b"+OK\r\n"
    s.sendall(b"*2\r\n$6\r\nEXISTS\r\n" + bulk(key))
    assert recv_exact(s, 4) == b":1\r\n"
    s.sendall(b"*2\r\n$3\r\nGET\r\n" + bulk(key))
    head = b"$%d\r\n" % len(chunk)
    assert recv_exact(s, len(head)) == head
    assert recv_exact(s, len(chunk)) == chunk
    assert recv_exact(s, 2) == b"\r\n"
    s.sendall(b"*2\r\n$3\r\nGET\r\n" + bulk(b"nope"))
    assert recv_exact(s, 5) == b"$-1\r\n"
    s.sendall(b"*2\r\n$3\r\nDEL\r\n" + bulk(key))
    assert recv_exact(s, 4) == b":1\r\n"
    s.sendall(b"*2\r\n$6\r\nEXISTS\r\n" + bulk(key))
    assert recv_exact(s, 4) == b":0\r\n"
    s.close()


def test_sglang_remote_loader_sequence(resp):
    """sglang/srt/connector/redis.py: SET tensors under <model>/keys/rank_<r>/<name>, list them
    with SCAN MATCH <prefix>* until the cursor comes back 0, then GET each."""
    redis = redis_module()
    _, host, port = resp
    r = redis.Redis(host=host, port=port)
    model = "Qwen/Qwen2-0.5B"
    tensors = {
        f"{model}/keys/rank_0/layer.{i}.weight": os.urandom(4096 + i)
        for i in range(300)
    }
    for k, v in tensors.items():
        r.set(k, v)
    r.set(f"{model}/keys/rank_1/other", b"x")
    r.set(f"{model}/files/config.json", b"{}")
    cursor, listed = 0, []
    while True:
        cursor, keys = r.scan(cursor=cursor, match=f"{model}/keys/rank_0/*")
        listed.extend(keys)
        if cursor == 0:
            break
    assert sorted(k.decode() for k in listed) == sorted(tensors)
    for k in listed:
        assert r.get(k) == tensors[k.decode()]
    r.close()


def test_many_clients_at_once(resp):
    """Eight threads, each with its own connection, interleaving writes and reads."""
    redis = redis_module()
    _, host, port = resp
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            r = redis.Redis(host=host, port=port, socket_timeout=30)
            for i in range(200):
                k = f"t{t}:{i}"
                r.set(k, k.encode() * 10)
                assert r.get(k) == k.encode() * 10
            r.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors

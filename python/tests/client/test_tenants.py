"""Tenants on one host, from Python: a namespace with a quota and tokens lives in a segment of
its own, and a same-host client maps only the segments its token admits to. A read token's
client reads its namespace through a read-only mapping and is refused every write."""

from __future__ import annotations

import os

import kvpool
import pytest

CONFIG = """
[[namespace]]
name = "a"
quota = "16MiB"
tokens = ["token-a"]
read_tokens = ["reader-a"]

[[namespace]]
name = "b"
quota = "16MiB"
tokens = ["token-b"]
"""


@pytest.fixture
def node(start_kvpoold, tmp_path):
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text(CONFIG)
    return start_kvpoold(memory="64MiB", extra=["--config", str(cfg)])


def test_a_read_token_reads_through_its_mapping_and_writes_nothing(node):
    value = os.urandom(1 << 20)
    with kvpool.Client(node.url, namespace="a", token="token-a") as a:
        assert a.is_local()
        a.write("k", value)
    with kvpool.Client(node.url, namespace="a", token="reader-a") as r:
        assert r.is_local()
        assert r.read("k") == value
        with pytest.raises(kvpool.AuthError):
            r.write("forged", b"bytes")
        with pytest.raises(kvpool.AuthError):
            r.delete("k")
    with kvpool.Client(node.url, namespace="a", token="token-a") as a:
        assert a.read("k") == value
        with pytest.raises(kvpool.NotFoundError):
            a.read("forged")


def test_another_tenant_neither_opens_nor_sees_the_namespace(node):
    with kvpool.Client(node.url, namespace="a", token="token-a") as a:
        a.write("secret", b"s" * 4096)
    with pytest.raises(kvpool.AuthError):
        kvpool.Client(node.url, namespace="a", token="token-b")
    with kvpool.Client(node.url, namespace="b", token="token-b") as b:
        assert b.is_local()
        with pytest.raises(kvpool.NotFoundError):
            b.read("secret")
        b.write("mine", b"m" * 4096)
        assert b.read("mine") == b"m" * 4096

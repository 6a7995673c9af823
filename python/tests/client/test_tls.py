"""The encrypted doors from Python: ``tls://`` (a node's ``listen.tls``, TCP with TLS 1.3) and
``quic://``, each trusting the node's generated certificate through ``ca``; without it they
refuse to connect."""

from __future__ import annotations

import os

import kvpool
import pytest


@pytest.fixture
def node(start_kvpoold):
    return start_kvpoold(extra=["--tls", "127.0.0.1:0"])


@pytest.mark.parametrize("door", ["tls", "quic"])
def test_encrypted_doors_round_trip_with_the_nodes_certificate(node, door):
    ca = node.dir / "tls-cert.pem"
    assert ca.exists()
    url = f"{door}://{node.addr(door)}"
    value = os.urandom(3 << 20)
    with kvpool.Client(url, same_host=False, ca=str(ca)) as c:
        assert not c.is_local()
        c.write(f"{door}-k", value)
        assert c.read(f"{door}-k") == value
    # What it wrote is the same object for a plain TCP client.
    with kvpool.Client(node.url, same_host=False) as plain:
        assert plain.read(f"{door}-k") == value


@pytest.mark.parametrize("door", ["tls", "quic"])
def test_encrypted_doors_need_a_ca(node, door):
    with pytest.raises(kvpool.ConnectionError):
        kvpool.Client(f"{door}://{node.addr(door)}", same_host=False)

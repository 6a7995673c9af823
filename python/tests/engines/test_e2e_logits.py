"""End to end on a real transformer: the KV that comes back from kvpool is the KV the model
would have computed.

A small LlamaForCausalLM built from a config (random weights, fixed seed, fp32, nothing
downloaded) prefills through :class:`kvpool.hf.PrefixCache` against a real kvpoold. Request 1
saves its full 16-token blocks; request 2 shares a prefix of three blocks and a few tokens,
loads the three blocks, computes only the rest, and its logits equal a full recompute's. With
kvpoold killed before request 2 it recomputes, gives the same logits, and the miss is counted.
A different model never hits the first one's blocks."""

from __future__ import annotations

import pytest
from conftest import require_module

BLOCK = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers, kvpool.hf), or a failure under CI when they are missing."""
    torch = require_module("torch", "scripts/python-env")
    transformers = require_module("transformers", "scripts/python-env")
    torch.set_num_threads(1)
    import kvpool.hf as kvhf

    return torch, transformers, kvhf


def tiny_llama(hf, seed: int, **over):
    torch, transformers, _ = hf
    cfg = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # Weights 5x the default scale: logits of unit spread, so that a KV error of 1e-3 in
        # one token of one layer moves them by more than the tolerance (measured: 5e-5).
        "initializer_range": 0.1,
    }
    cfg.update(over)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    return model.to(torch.float32).eval()


def prompts(hf):
    """Request 1: 5 full blocks and 5 tokens. Request 2: the first 3 blocks and 7 more tokens
    of request 1, then 40 other tokens (so block 3 differs and 3 blocks are shared)."""
    torch = hf[0]
    g = torch.Generator().manual_seed(7)
    p1 = torch.randint(0, 512, (5 * BLOCK + 5,), generator=g).tolist()
    p2 = p1[: 3 * BLOCK + 7] + torch.randint(0, 512, (40,), generator=g).tolist()
    assert p2[3 * BLOCK : 4 * BLOCK] != p1[3 * BLOCK : 4 * BLOCK]  # block 3 differs
    return p1, p2


def full_logits(hf, model, tokens):
    torch = hf[0]
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits


def store(url: str, same_host: bool = True):
    from kvpool.engine import EngineStore

    # Generous deadlines: the suite shares two cores; a dead daemon still answers at once.
    return EngineStore(url, lookup_timeout=2.0, io_timeout=10.0, same_host=same_host)


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "tcp"])
def test_loaded_prefix_gives_the_logits_of_a_full_recompute(hf, kvpoold, same_host):
    kvhf = hf[2]
    model = tiny_llama(hf, seed=0)
    p1, p2 = prompts(hf)
    st = store(kvpoold.url, same_host)
    pc = kvhf.PrefixCache(st, model, BLOCK)

    r1 = pc.prefill(p1)
    assert (r1.tokens_loaded, r1.tokens_computed) == (0, len(p1))
    assert r1.blocks_saved == 5  # the partial last block (5 tokens) is never stored
    assert (r1.logits - full_logits(hf, model, p1)).abs().max().item() <= TOL
    assert st.stats()["bytes_written"] == 5 * pc.block_bytes

    r2 = pc.prefill(p2)
    assert r2.tokens_loaded == 3 * BLOCK
    assert (
        r2.tokens_computed == len(p2) - 3 * BLOCK
    )  # reduced by exactly the loaded prefix
    ref = full_logits(hf, model, p2)
    assert r2.logits.shape == (1, len(p2) - 3 * BLOCK, 512)
    diff = (r2.logits - ref[:, 3 * BLOCK :]).abs().max().item()
    assert diff <= TOL, f"max abs logit difference {diff}"
    # The whole context's KV is in the returned cache, the loaded part included.
    assert r2.cache.get_seq_length() == len(p2)
    assert r2.blocks_saved == len(p2) // BLOCK - 3
    s = st.stats()
    assert (s["hits"], s["errors"]) == (3, 0)
    assert s["bytes_read"] == 3 * pc.block_bytes
    # A third request with request 2's prompt loads all its full blocks but the last token's.
    r3 = pc.prefill(p2)
    assert r3.tokens_loaded == (len(p2) // BLOCK) * BLOCK
    assert (r3.logits - ref[:, r3.tokens_loaded :]).abs().max().item() <= TOL
    pc.close()
    st.close()


def test_killed_daemon_recomputes_the_same_logits_and_counts_the_miss(hf, kvpoold):
    model = tiny_llama(hf, seed=0)
    p1, p2 = prompts(hf)
    st = store(kvpoold.url)
    pc = hf[2].PrefixCache(st, model, BLOCK)
    assert pc.prefill(p1).blocks_saved == 5
    before = st.stats()
    assert before["misses"] == 5 and before["errors"] == 0  # request 1: a cold pool
    kvpoold.kill()

    r2 = pc.prefill(p2)
    assert (r2.tokens_loaded, r2.tokens_computed) == (0, len(p2))
    diff = (r2.logits - full_logits(hf, model, p2)).abs().max().item()
    assert diff <= TOL, f"max abs logit difference {diff}"
    s = st.stats()
    assert s["hits"] == 0
    # Every full block of request 2 is a miss, and the failed lookup an error.
    assert s["misses"] - before["misses"] == len(p2) // BLOCK
    assert s["errors"] >= 1
    assert s["stores"] == before["stores"]  # its save did not pretend
    st.close()


def test_another_model_never_hits(hf, kvpoold):
    kvhf = hf[2]
    p1, _ = prompts(hf)
    st = store(kvpoold.url)
    a = kvhf.PrefixCache(st, tiny_llama(hf, seed=0), BLOCK)
    assert a.prefill(p1).blocks_saved == 5
    others = [
        tiny_llama(hf, seed=1),  # same architecture, other weights
        tiny_llama(hf, seed=0, num_key_value_heads=4),  # other geometry
    ]
    for model in others:
        other = kvhf.PrefixCache(st, model, BLOCK)
        assert other.model_id != a.model_id
        assert st.match_prefix(other.keys(p1)) == 0
        r = other.prefill(p1)
        assert (r.tokens_loaded, r.tokens_computed) == (0, len(p1))
    # The first model still hits its own blocks; another block size is another key space.
    assert a.prefill(p1).tokens_loaded == 5 * BLOCK
    assert st.match_prefix(kvhf.PrefixCache(st, a.model, 2 * BLOCK).keys(p1)) == 0
    st.close()


def test_a_sliding_window_model_is_refused(hf, kvpoold):
    _, transformers, kvhf = hf
    cfg = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    model = transformers.MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="full-attention"):
        kvhf.PrefixCache(store(kvpoold.url), model, BLOCK)

"""kvpool.vllm.KvpoolConnector with vLLM's hybrid KV cache manager (HMA), against vllm 0.33.0's
real scheduler and KV cache manager on the CPU and a real kvpoold (the harness of
``_vllm_setup.py``).

The model is Llama-3-8B-shaped with every odd layer a 32-token sliding window (as Gemma
alternates them). vLLM's own planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``) makes it two KV cache groups, full attention and sliding
window, overlaying one allocation; its KV cache manager gives each group its own block ids and
nulls the sliding window's blocks below the window.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from conftest import in_ci

try:
    import _vllm_setup as base
    import torch
    from kvpool import Client
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        SlidingWindowSpec,
    )
except ImportError as e:  # pragma: no cover - the environment decides
    if in_ci():
        raise
    pytest.skip(
        f"vllm 0.33.0 is not installed ({e}): scripts/python-env",
        allow_module_level=True,
    )

BLOCK, KV_HEADS, HEAD = base.BLOCK, base.KV_HEADS, base.HEAD
WINDOW = 2 * BLOCK
FULL, SLIDING = 0, 1  # the groups vLLM's planner makes, in its order
NUM_BLOCKS = 24


@pytest.fixture
def models(tmp_path):
    return tmp_path


def hybrid_config(path: str, url: str) -> KVCacheConfig:
    """The KV cache config vLLM plans for the hybrid model, with HMA on."""
    vc = base.vllm_config(path, url)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    vc.cache_config.kv_cache_layout = "LBHNC"
    specs = {}
    for i, name in enumerate(base.LAYER_NAMES):
        geometry = {
            "block_size": BLOCK,
            "num_kv_heads": KV_HEADS,
            "head_size": HEAD,
            "dtype": torch.bfloat16,
        }
        if i % 2:
            specs[name] = SlidingWindowSpec(sliding_window=WINDOW, **geometry)
        else:
            specs[name] = FullAttentionSpec(**geometry)
    groups = get_kv_cache_groups(vc, specs)
    page = groups[0].kv_cache_spec.page_size_bytes
    kcc = get_kv_cache_config_from_groups(vc, groups, page * 16 * NUM_BLOCKS)
    kinds = [type(g.kv_cache_spec) for g in kcc.kv_cache_groups]
    assert kinds == [FullAttentionSpec, SlidingWindowSpec]
    assert kcc.num_blocks == NUM_BLOCKS
    return kcc


def engine(path: str, url: str, **extra) -> base.Engine:
    return base.Engine(path, url, kcc=hybrid_config(path, url), **extra)


def group_pages(e: base.Engine, group: int, block_ids: list[int]) -> list[torch.Tensor]:
    """The group's layers' pages of these blocks, as raw 16-bit words."""
    idx = torch.tensor(block_ids)
    names = e.sched.kv_cache_config.kv_cache_groups[group].layer_names
    return [e.kv[n].index_select(0, idx).view(torch.int16) for n in names]


def request(prompt: list[int], rid: str = "q") -> base.Request:
    return base.Request(
        rid, prompt, base.SamplingParams(max_tokens=1), None, block_hasher=base.HASHER
    )


def saved_blocks(e: base.Engine, prompt: list[int]) -> list[list[int]]:
    """Request r1 runs its prompt in one step; returns its blocks per group."""
    e.add("r1", prompt, max_tokens=1)
    out, kvo = e.step(fill_seed=1)
    (save,) = out.kv_connector_metadata.saves
    assert kvo.failed_recving == set()
    return save.groups()


@pytest.mark.parametrize("staging", [False, True])
def test_each_group_is_saved_and_loaded_into_another_engines_blocks(
    kvpoold, models, staging
):
    """Engine A saves both groups of every full block; engine B's scheduler takes a 5-block
    hit, and its KV cache manager gives it other block ids per group, with the sliding
    window's blocks below the window left null: B loads the full-attention group's 5 blocks
    and the window's last 2, and each group's bytes equal A's (through host pages, and
    through staging as for a device cache)."""
    path = base.model_dir(models, "hybrid")
    a = engine(path, kvpoold.url)
    if staging:
        a.use_staging()
    assert a.conn.enabled and len(a.conn.layouts) == 2
    prompt1 = base.tokens(5 * BLOCK + 8, seed=31)
    full_ids, window_ids = saved_blocks(a, prompt1)
    assert len(full_ids) == len(window_ids) == 5
    w = a.worker
    assert w.store.stats()["stores"] == 2 * 5  # one object per block and group
    h0 = request(prompt1).block_hashes[0].hex()
    keys = w.keys(h0)
    assert len(keys) == len(set(keys)) == 2  # groups never share a key

    b = engine(path, kvpoold.url)
    if staging:
        b.use_staging()
    b.add("filler", base.tokens(3 * BLOCK, seed=39), max_tokens=8)
    b.step(fill_seed=3)
    prompt2 = prompt1[: 5 * BLOCK] + base.tokens(20, seed=32)
    b.add("r2", prompt2)
    out, _ = b.step(fill_seed=4)
    (load,) = out.kv_connector_metadata.loads
    loaded_full, loaded_window = load.groups()
    assert loaded_full == load.block_ids and len(loaded_full) == 5
    assert set(loaded_full).isdisjoint(full_ids)
    # vLLM allocated the window's blocks 3 and 4 only (tokens 49..79 are in the window of
    # token 80); the connector moves nothing for the null ones.
    assert loaded_window[:3] == [-1, -1, -1] and -1 not in loaded_window[3:]
    nr = b.wait_loaded("r2")
    assert nr.num_computed_tokens == 5 * BLOCK
    assert list(nr.block_ids[FULL][:5]) == loaded_full
    assert list(nr.block_ids[SLIDING][3:5]) == loaded_window[3:]
    for pa, pb in zip(
        group_pages(a, FULL, full_ids), group_pages(b, FULL, loaded_full)
    ):
        assert torch.equal(pa, pb)
    want = group_pages(a, SLIDING, window_ids[3:])
    for pa, pb in zip(want, group_pages(b, SLIDING, loaded_window[3:])):
        assert torch.equal(pa, pb)
    assert b.worker.store.stats()["hits"] == 5 + 2
    a.close()
    b.close()


def test_a_hit_needs_every_group_and_only_the_windows_blocks(kvpoold, models):
    """One ``presence`` round trip per lookup. A sliding-window object below the window of
    the boundary is not needed; one inside it, or any full-attention object, is."""
    path = base.model_dir(models, "hybrid")
    a = engine(path, kvpoold.url)
    prompt = base.tokens(6 * BLOCK + 3, seed=33)
    saved_blocks(a, prompt)
    hashes = [h.hex() for h in request(prompt).block_hashes]
    cl = Client(kvpoold.url)

    def hit() -> int:
        c = engine(path, kvpoold.url)
        lookups = c.conn.store.stats()["lookups"]
        n, _ = c.conn.get_num_new_matched_tokens(request(prompt), 0)
        assert c.conn.store.stats()["lookups"] == lookups + 1
        c.close()
        return n // BLOCK

    # A hit at boundary n (blocks) needs full attention's blocks 0..n-1 and the window's
    # blocks from (16 n - 31) // 16: tokens 16 n - 31 .. 16 n - 1 are the window of token 16 n.
    assert hit() == 6
    full_keys, window_keys = zip(*(a.worker.keys(h) for h in hashes))
    assert cl.delete(window_keys[1])  # below the window of boundary 6 (blocks 4, 5)
    assert hit() == 6
    assert cl.delete(window_keys[5])  # inside it: boundary 5 needs window blocks 3, 4
    assert hit() == 5
    assert cl.delete(full_keys[4])  # boundary 4 needs full blocks 0..3, window 2, 3
    assert hit() == 4
    assert cl.delete(window_keys[3])  # boundaries 3 and 2 need the window's block 1
    assert hit() == 1
    cl.close()
    a.close()


def test_a_failed_load_is_reported_per_request_and_recomputed(kvpoold, models):
    """vLLM cannot map block ids back to requests with several groups, so a failed load is
    reported in ``failed_recving`` (never as block ids, which vLLM refuses here): the
    request is recomputed from its first token, and nothing raises. A synchronous load
    could not be reported at all, so the connector loads asynchronously."""
    path = base.model_dir(models, "hybrid")
    a = engine(path, kvpoold.url)
    prompt = base.tokens(4 * BLOCK + 5, seed=34)
    saved_blocks(a, prompt)
    b = engine(path, kvpoold.url, load_async=False)
    assert b.conn.load_async and b.worker.load_async
    b.add("r2", prompt)

    def evict(meta):
        (load,) = meta.loads
        cl = Client(kvpoold.url)
        assert cl.delete(b.worker.keys(load.hashes[1])[0])
        cl.close()

    out, kvo = b.step(before_worker=evict)
    failed: set[str] = set(kvo.failed_recving)
    nr = None
    for _ in range(20):
        out, kvo = b.step(fill_seed=6)
        failed |= kvo.failed_recving
        assert not kvo.invalid_block_ids
        nr = next((r for r in out.scheduled_new_reqs if r.req_id == "r2"), None)
        if nr:
            break
    assert failed == {"r2"}
    assert nr is not None and nr.num_computed_tokens == 0
    a.close()
    b.close()


def test_the_hit_rule_matches_vllms_window_on_random_presence(kvpoold, models):
    """The scheduler's longest hit, checked against vLLM's own window arithmetic
    (``SlidingWindowManager.get_num_skipped_tokens``: tokens before ``n - window + 1`` are
    skipped) on random presence of each group's objects, from several starting blocks."""
    path = base.model_dir(models, "hybrid")
    e = engine(path, kvpoold.url)
    conn = e.conn
    assert len(conn._block_salts) == 2  # one object per block: full, then window
    g = torch.Generator().manual_seed(35)
    for trial in range(300):
        first = trial % 4
        blocks = int(torch.randint(1, 12, (1,), generator=g))
        present = (torch.rand(2 * blocks, generator=g) < 0.85).tolist()
        full, window = present[0::2], present[1::2]

        want = max(
            (m for m in range(1, blocks + 1) if hit_ok(first, m, full, window)),
            default=0,
        )
        assert conn._windowed_hit(present, first) == want, (first, full, window)
    e.close()


def hit_ok(first: int, m: int, full: list[bool], window: list[bool]) -> bool:
    """vLLM's rule for a hit of ``m`` blocks after ``first``: every full-attention block, and
    the window's blocks from the first one vLLM does not skip for the token at the boundary."""
    end = first + m  # the boundary, in blocks of the request
    skipped = max(0, end * BLOCK - WINDOW + 1) // BLOCK
    lo = max(first, skipped)
    return all(full[:m]) and all(window[lo - first : m])

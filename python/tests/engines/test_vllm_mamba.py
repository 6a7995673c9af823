"""kvpool.vllm.KvpoolConnector with a hybrid attention + Mamba model, against vllm 0.33.0's real
scheduler and KV cache manager on the CPU, in vLLM's Mamba prefix-caching mode ``align``, and a
real kvpoold (the harness of ``_vllm_setup.py``).

The model alternates Llama-3-8B attention layers with Mamba2 layers (a conv state and an SSM
state per layer, bf16), as Jamba and Bamba do. vLLM's own planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``) makes two KV cache groups, full attention and Mamba,
overlaying one allocation (the state's page padded to the attention page). vLLM's scheduler
ends prefill chunks at block boundaries, and its Mamba manager caches the state at each chunk
end and offers it to the connector (``SchedulerOutput.kv_connector_block_state``); a hit needs
every attention block before its boundary and the state at the boundary.
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
    from kvpool._vllm_meta import NO_BLOCK
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        MambaSpec,
    )
except ImportError as e:  # pragma: no cover - the environment decides
    if in_ci():
        raise
    pytest.skip(
        f"vllm 0.33.0 is not installed ({e}): scripts/python-env",
        allow_module_level=True,
    )

BLOCK, KV_HEADS, HEAD = base.BLOCK, base.KV_HEADS, base.HEAD
ATTN, MAMBA = 0, 1  # the groups vLLM's planner makes, in its order
NUM_BLOCKS = 24
# A Mamba2 layer's state (Bamba-9B-like, one rank): the conv state [conv width - 1, channels]
# and the SSM state [heads, head dim, state size]; 63 488 bytes, padded to the attention
# page (65 536).
CONV, SSM = (3, 1024), (8, 64, 56)
CACHE = {"mamba_cache_mode": "align"}


@pytest.fixture
def models(tmp_path):
    return tmp_path


def hybrid_config(path: str, url: str) -> KVCacheConfig:
    """The KV cache config vLLM plans for the hybrid model, Mamba prefix caching on."""
    vc = base.vllm_config(path, url, cache=CACHE)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    vc.cache_config.kv_cache_layout = "LBHNC"
    attn = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=(CONV, SSM),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=attn.page_size_bytes,
        mamba_cache_mode="align",
    )
    specs = {name: mamba if i % 2 else attn for i, name in enumerate(base.LAYER_NAMES)}
    groups = get_kv_cache_groups(vc, specs)
    kcc = get_kv_cache_config_from_groups(
        vc, groups, attn.page_size_bytes * 16 * NUM_BLOCKS
    )
    kinds = [type(g.kv_cache_spec) for g in kcc.kv_cache_groups]
    assert kinds == [FullAttentionSpec, MambaSpec]
    assert kcc.num_blocks == NUM_BLOCKS
    return kcc


def engine(path: str, url: str, **extra) -> base.Engine:
    return base.Engine(path, url, kcc=hybrid_config(path, url), cache=CACHE, **extra)


def group_pages(e: base.Engine, group: int, block_ids: list[int]) -> list[torch.Tensor]:
    """The group's layers' pages of these blocks (a state's without vLLM's padding)."""
    idx = torch.tensor(block_ids)
    names = e.sched.kv_cache_config.kv_cache_groups[group].layer_names
    return [e.kv[n].index_select(0, idx).clone() for n in names]


def run(e: base.Engine, rid: str, prompt: list[int], fill_seed: int):
    """Runs a request to its end; returns every save job of its steps and, per Mamba
    state saved, (boundary block, its pages right after the step that wrote it)."""
    e.add(rid, prompt, max_tokens=1)
    saves, states = [], {}
    for step in range(20):
        out, kvo = e.step(fill_seed=fill_seed + step)
        assert not kvo.failed_recving
        for job in out.kv_connector_metadata.saves:
            saves.append(job)
            block = job.groups()[MAMBA][-1]
            if block != NO_BLOCK:
                states[len(saves) - 1] = group_pages(e, MAMBA, [block])
        if e.sched.requests.get(rid) is None:
            return saves, states
    raise AssertionError(f"{rid} never finished")


@pytest.mark.parametrize("staging", [False, True])
def test_states_at_block_boundaries_are_saved_and_loaded_into_another_engine(
    kvpoold, models, staging
):
    """Engine A runs a 5-block-and-8-token prompt: vLLM ends the first chunk at the 5-block
    boundary and offers the state there; the connector saves it under that block's hash,
    apart from the attention blocks. Engine B's request shares the 5 blocks: the scheduler
    takes a 5-block hit, vLLM gives the state the block at position 4, and the load puts
    A's state bytes there and A's attention pages into B's attention blocks (through host
    pages, and through staging as for a device cache)."""
    path = base.model_dir(models, "hybrid")
    a = engine(path, kvpoold.url)
    if staging:
        a.use_staging()
    assert a.conn.enabled and [lay.kind for lay in a.conn.layouts] == [
        "full",
        "mamba_state",
    ]
    prompt1 = base.tokens(5 * BLOCK + 8, seed=41)
    hashes = [h.hex() for h in base.request("q", prompt1).block_hashes]
    saves, states = run(a, "r1", prompt1, fill_seed=1)
    attn_saved = [
        (h, b) for job in saves for h, b in zip(job.hashes, job.groups()[ATTN])
    ]
    attn_saved = [(h, b) for h, b in attn_saved if b != NO_BLOCK]
    assert [h for h, _ in attn_saved] == hashes
    state_jobs = {
        i: job for i, job in enumerate(saves) if job.groups()[MAMBA][-1] != NO_BLOCK
    }
    # One state, at the 5-block boundary (the chunk end): a state job moves no attention.
    assert [job.hashes for job in state_jobs.values()] == [[hashes[4]]]
    ((si, sjob),) = state_jobs.items()
    assert sjob.groups()[ATTN] == [NO_BLOCK]
    want_state = states[si]
    want_attn = group_pages(a, ATTN, [b for _, b in attn_saved])
    full_key, state_key = a.worker.keys(hashes[4])
    assert full_key != state_key  # groups never share a key
    cl = Client(kvpoold.url)
    assert cl.batch_exists([state_key]) == [True]
    cl.close()

    b = engine(path, kvpoold.url)
    if staging:
        b.use_staging()
    prompt2 = prompt1[: 5 * BLOCK] + base.tokens(20, seed=42)
    b.add("r2", prompt2)
    out, _ = b.step(fill_seed=4)
    (load,) = out.kv_connector_metadata.loads
    loaded_attn, loaded_state = load.groups()
    assert load.hashes == hashes[:5] and len(loaded_attn) == 5
    assert loaded_state[:4] == [NO_BLOCK] * 4 and loaded_state[4] != NO_BLOCK
    nr = b.wait_loaded("r2")
    assert nr.num_computed_tokens == 5 * BLOCK
    assert list(nr.block_ids[ATTN][:5]) == loaded_attn
    assert nr.block_ids[MAMBA][4] == loaded_state[4]
    for pa, pb in zip(want_attn, group_pages(b, ATTN, loaded_attn)):
        assert torch.equal(pa, pb)
    for pa, pb in zip(want_state, group_pages(b, MAMBA, [loaded_state[4]])):
        assert torch.equal(pa, pb)
    assert b.worker.store.stats()["hits"] == 5 + 1
    a.close()
    b.close()


def test_a_hit_needs_the_state_at_its_boundary_and_every_attention_block(
    kvpoold, models
):
    """Engine A leaves states at the 3- and 5-block boundaries (a 3-block prompt, then a
    5-block one that hits it locally). One ``presence`` round trip per lookup. Without the
    5-block state the hit falls back to the 3-block boundary; without an attention block
    below it, to nothing, though states remain."""
    path = base.model_dir(models, "hybrid")
    a = engine(path, kvpoold.url)
    prompt = base.tokens(6 * BLOCK + 3, seed=43)
    run(a, "r1", prompt[: 3 * BLOCK + 1], fill_seed=1)
    run(a, "r1b", prompt[: 5 * BLOCK + 1], fill_seed=11)
    hashes = [h.hex() for h in base.request("q", prompt).block_hashes]
    attn_keys, state_keys = zip(*(a.worker.keys(h) for h in hashes))
    cl = Client(kvpoold.url)
    assert cl.batch_exists(list(state_keys)) == [False, False, True, False, True, False]

    def hit() -> int:
        c = engine(path, kvpoold.url)
        lookups = c.conn.store.stats()["lookups"]
        n, _ = c.conn.get_num_new_matched_tokens(base.request("q", prompt), 0)
        assert c.conn.store.stats()["lookups"] == lookups + 1
        c.close()
        return n // BLOCK

    assert hit() == 5
    assert cl.delete(state_keys[4])
    assert hit() == 3
    assert cl.delete(attn_keys[1])
    assert hit() == 0
    cl.close()
    a.close()


def test_the_hit_rule_on_random_presence(kvpoold, models):
    """The scheduler's longest hit on random presence of each group's objects, from several
    starting blocks, against the rule: every attention block from the start to the
    boundary, and the state at the boundary."""
    path = base.model_dir(models, "hybrid")
    e = engine(path, kvpoold.url)
    conn = e.conn
    assert len(conn._block_salts) == 2  # one object per block: attention, then state
    g = torch.Generator().manual_seed(44)
    for trial in range(300):
        first = trial % 4
        blocks = int(torch.randint(1, 12, (1,), generator=g))
        present = (torch.rand(2 * blocks, generator=g) < 0.7).tolist()
        attn, state = present[0::2], present[1::2]
        want = max(
            (m for m in range(1, blocks + 1) if all(attn[:m]) and state[m - 1]),
            default=0,
        )
        assert conn._windowed_hit(present, first) == want, (first, attn, state)
    e.close()


def test_a_state_that_fails_to_load_recomputes_the_request(kvpoold, models):
    """The state vanishes between the lookup and the load: the request is reported in
    ``failed_recving`` and vLLM recomputes it from its first token; nothing raises."""
    path = base.model_dir(models, "hybrid")
    a = engine(path, kvpoold.url)
    prompt = base.tokens(4 * BLOCK + 5, seed=45)
    run(a, "r1", prompt, fill_seed=1)
    b = engine(path, kvpoold.url)
    b.add("r2", prompt)

    def evict(meta):
        (load,) = meta.loads
        assert load.groups()[MAMBA][-1] != NO_BLOCK
        cl = Client(kvpoold.url)
        assert cl.delete(b.worker.keys(load.hashes[-1])[MAMBA])
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


def test_each_tensor_parallel_rank_stores_and_loads_its_own_state(kvpoold, models):
    """At TP 2 each rank's state shard is its own object, written by that rank (the ranks'
    bytes differ here), and a TP-2 reader's ranks each load their own; a reader at TP 1 names
    other keys and misses."""
    path = base.model_dir(models, "hybrid")
    kcc = hybrid_config(path, kvpoold.url)
    a = base.Engine(path, kvpoold.url, tp=2, kcc=kcc, cache=CACHE)
    prompt = base.tokens(3 * BLOCK + 2, seed=46)
    a.add("r1", prompt, max_tokens=1)
    state_block, want = None, []
    for step in range(20):
        out, _ = a.step(fill_seed=1 + step)
        for job in out.kv_connector_metadata.saves:
            if job.groups()[MAMBA][-1] != NO_BLOCK:
                state_block = job.groups()[MAMBA][-1]
                names = kcc.kv_cache_groups[MAMBA].layer_names
                want = [[kv[n][state_block].clone() for n in names] for kv in a.kvs]
        if a.sched.requests.get("r1") is None:
            break
    assert state_block is not None
    assert not torch.equal(want[0][0], want[1][0])
    for w in a.workers:
        assert len(w.keys(base.request("q", prompt).block_hashes[2].hex())) == 2

    b = base.Engine(path, kvpoold.url, tp=2, kcc=kcc, cache=CACHE)
    b.add("r2", prompt[: 3 * BLOCK] + base.tokens(9, seed=47))
    out, _ = b.step()
    (load,) = out.kv_connector_metadata.loads
    block = load.groups()[MAMBA][-1]
    assert len(load.hashes) == 3 and block != NO_BLOCK
    assert b.wait_loaded("r2").num_computed_tokens == 3 * BLOCK
    names = kcc.kv_cache_groups[MAMBA].layer_names
    for rank, kv in enumerate(b.kvs):
        for n, page in zip(names, want[rank]):
            assert torch.equal(kv[n][block], page)

    c = engine(path, kvpoold.url)
    n, _ = c.conn.get_num_new_matched_tokens(base.request("q", prompt), 0)
    assert n == 0
    for e in (a, b, c):
        e.close()

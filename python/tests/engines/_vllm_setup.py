"""The vLLM harness the vLLM tests share (``test_vllm.py``, ``test_vllm_tp.py``,
``test_vllm_hma.py``, ``test_vllm_mamba.py``, ``test_vllm_offload.py``): a Llama-3-8B-shaped
model directory, the ``VllmConfig`` that ``vllm serve`` builds from it and a
``--kv-transfer-config``, vLLM's real ``Scheduler`` over a KV cache config, requests hashed as
vLLM hashes them, and :class:`Engine`, kvpool's connector driven in the model runner's order
on KV tensors from vLLM's own ``allocate_kv_cache``.

Importing it needs vllm 0.33.0: a test module imports it inside its ``try`` and fails (in CI)
or skips without it.
"""

from __future__ import annotations

import json
import time

import torch
from kvpool.vllm import KvpoolConnector, KvpoolConnectorMetadata
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

# Llama-3-8B's KV geometry; a few blocks only (each block object is 2 MiB).
LAYERS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
NUM_BLOCKS = 16
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS,
    "head_dim": HEAD,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
# The --kv-transfer-config of docs/ENGINES.md, byte for byte.
LAUNCH = (
    '{"kv_connector":"KvpoolConnector","kv_connector_module_path":"kvpool.vllm",'
    '"kv_role":"kv_both","kv_connector_extra_config":{"kvpool_url":"tcp://127.0.0.1:7070"}}'
)
# Small staging (6 blocks, batches of 4) so that batching and slot reuse are exercised.
TEST_EXTRA = {
    "lookup_timeout": 2.0,
    "io_timeout": 2.0,
    "staging_blocks": 6,
    "batch_blocks": 4,
}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def model_dir(root, name: str) -> str:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    return str(d)


def engine_config(path: str, kvt: KVTransferConfig) -> VllmConfig:
    """What ``vllm serve PATH --kv-transfer-config KVT`` builds (prefix caching on, 16-token
    blocks, ``NUM_BLOCKS`` blocks)."""
    mc = ModelConfig(
        model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
    )
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False
        ),
        kv_transfer_config=kvt,
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def vllm_config(
    path: str,
    url: str,
    tp: int = 1,
    cache: dict[str, object] | None = None,
    **extra,
) -> VllmConfig:
    """``engine_config`` with kvpool's connector from ``LAUNCH`` (its extra config updated
    by ``extra``). ``tp``: the tensor parallel size (set after the config is built: the CPU
    platform has no second device); ``cache``: ``CacheConfig`` settings."""
    launch = json.loads(LAUNCH.replace("tcp://127.0.0.1:7070", url))
    launch["kv_connector_extra_config"].update(TEST_EXTRA, **extra)
    vc = engine_config(path, KVTransferConfig(**launch))
    vc.parallel_config.tensor_parallel_size = tp
    for key, value in (cache or {}).items():
        setattr(vc.cache_config, key, value)
    return vc


def kv_cache_config(
    layout: KVCacheLayout = KVCacheLayout.LBHNC, heads: int = KV_HEADS
) -> KVCacheConfig:
    """One backing allocation for the 32 layers, layer-outermost (LBHNC) or block-outermost;
    ``heads``: the KV heads of one rank."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        strides = (page * NUM_BLOCKS, page)
    else:
        strides = (page, page * LAYERS)
    tensor = KVCacheTensor(
        size=page * NUM_BLOCKS * LAYERS,
        layers=list(LAYER_NAMES),
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
    )


def scheduler(vc: VllmConfig, kcc: KVCacheConfig) -> Scheduler:
    """vLLM's real scheduler over ``kcc`` (it builds the config's connector)."""
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
    )


def request(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    """A request over ``prompt``, its blocks hashed as vLLM hashes them."""
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=HASHER,
    )


def model_output(out, kvo: KVConnectorOutput) -> ModelRunnerOutput:
    """The model runner's output for a scheduler output: one token sampled per request."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=kvo,
    )


class Engine:
    """vLLM's real scheduler plus one worker-role connector per tensor-parallel rank, each on
    its own CPU KV tensors (what each rank's GPU would hold)."""

    def __init__(
        self,
        path: str,
        url: str,
        layout: KVCacheLayout = KVCacheLayout.LBHNC,
        tp: int = 1,
        kcc: KVCacheConfig | None = None,
        replicated: bool = False,
        cache: dict[str, object] | None = None,
        **extra,
    ):
        """``kcc``: the KV cache config (default: Llama-3-8B's, all KV heads on every rank);
        ``replicated``: every rank's forward writes the same KV (an MLA latent); ``cache``:
        ``CacheConfig`` settings (``vllm serve``'s cache flags, e.g. Mamba's cache mode)."""
        kcc = kcc or kv_cache_config(layout)
        self.replicated = replicated
        # Each layer's KV cache group: its blocks are that group's block ids.
        self.group_of = {
            n: g for g, grp in enumerate(kcc.kv_cache_groups) for n in grp.layer_names
        }
        vc = vllm_config(path, url, tp=tp, cache=cache, **extra)
        self.sched = scheduler(vc, kcc)
        self.conn: KvpoolConnector = self.sched.connector
        self.workers: list[KvpoolConnector] = []
        self.kvs: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):
            wvc = (
                vllm_config(path, url, tp=tp, cache=cache, tp_rank=rank, **extra)
                if tp > 1
                else vc
            )
            w = KVConnectorFactory.create_connector(wvc, KVConnectorRole.WORKER, kcc)
            kv = allocate_kv_cache(kcc, torch.device("cpu"), layout)
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.recving: dict[str, int] = {}  # finished_recving reports per request

    def add(self, rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
        req = request(rid, tokens, max_tokens)
        self.sched.add_request(req)
        return req

    def step(
        self, fill_seed: int | None = None, before_worker=None, before_forward=None
    ):
        """One engine step: schedule; on every rank, the connector calls in the model runner's
        order around a "forward" that writes random KV into the scheduled blocks; then the
        ranks' outputs aggregated as vLLM's KVOutputAggregator does (a load is finished when
        every rank reported it) and fed back to the scheduler. Returns (scheduler output,
        KVConnectorOutput)."""
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KvpoolConnectorMetadata)
        if before_worker is not None:
            before_worker(meta)
        finished: set[str] = set()
        failed: set[str] = set()
        errors: set[int] = set()
        stats = None
        for rank, (w, kv) in enumerate(zip(self.workers, self.kvs)):
            w.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                w.start_load_kv(None)
            if before_forward is not None:
                before_forward(out, rank)
            for name in LAYER_NAMES:
                w.wait_for_layer_load(name)
                if fill_seed is not None:
                    seed = fill_seed + (0 if self.replicated else 1000 * rank)
                    self.forward_layer(out, kv, name, seed)
                w.save_kv_layer(name, kv[name], None)
            if not out.has_sync_kv_loads:
                w.start_load_kv(None)  # async loads start after the forward is launched
            w.wait_for_save()
            assert w.flush(10.0)
            res = w.get_transfer_results(set(out.finished_req_ids))
            failed |= res.failed_recving
            for rid in res.finished_recving:
                self.recving[rid] = self.recving.get(rid, 0) + 1
                if self.recving[rid] == len(self.workers):
                    finished.add(rid)
                    del self.recving[rid]
            errors |= w.get_block_ids_with_load_errors()
            s = w.get_kv_connector_stats()
            if s is not None:
                stats = s if stats is None else stats.aggregate(s)
            w.clear_connector_metadata()
        kvo = KVConnectorOutput(
            finished_recving=finished or None,
            failed_recving=failed & finished,
            invalid_block_ids=errors,
            kv_connector_stats=stats,
        )
        self.sched.update_from_output(out, model_output(out, kvo))
        return out, kvo

    def forward_layer(self, out, kv, name: str, seed: int) -> None:
        """Writes KV into the blocks of the tokens computed in this step (a stand-in for the
        attention kernel's cache write; whole blocks, which is all the connector reads)."""
        g = torch.Generator().manual_seed(seed + LAYER_NAMES.index(name))
        t = kv[name]
        for nr in out.scheduled_new_reqs:
            first = nr.num_computed_tokens // BLOCK
            for b in nr.block_ids[self.group_of[name]][first:]:
                if t.dtype == torch.int8:  # raw state bytes (a Mamba layer's page)
                    t[b] = torch.randint(-128, 128, t.shape[1:], generator=g).to(
                        t.dtype
                    )
                else:
                    t[b] = torch.randn(t.shape[1:], generator=g).to(t.dtype)

    def wait_loaded(self, rid: str, steps: int = 20):
        """Steps until the request leaves WAITING_FOR_REMOTE_KVS and is scheduled; returns its
        NewRequestData."""
        for _ in range(steps):
            out, _ = self.step()
            for nr in out.scheduled_new_reqs:
                if nr.req_id == rid:
                    return nr
            time.sleep(0.01)
        raise AssertionError(f"{rid} was never scheduled")

    def pages(self, block_ids: list[int], rank: int = 0) -> list[torch.Tensor]:
        """Every layer's pages of these blocks, as raw 16-bit words (bitwise comparison)."""
        idx = torch.tensor(block_ids)
        kv = self.kvs[rank]
        return [kv[n].index_select(0, idx).view(torch.int16) for n in LAYER_NAMES]

    def use_staging(self) -> Engine:
        """Makes the workers move bytes as they do for a device cache: through the staging
        buffer with torch's indexed copies, instead of ``memmove`` into host pages."""
        for w in self.workers:
            w._direct = []
            w._host_pages = lambda block_ids: False
        return self

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.conn.shutdown()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 999, (n,), generator=g).tolist()


def save_request_1(engine: Engine, prompt: list[int]) -> list[int]:
    """Request 1 runs one step (the whole prompt) and its full blocks are saved."""
    req = engine.add("r1", prompt, max_tokens=1)
    out, kvo = engine.step(fill_seed=1)
    meta = out.kv_connector_metadata
    assert meta.loads == [] and len(meta.saves) == 1
    save = meta.saves[0]
    assert save.req_id == "r1" and len(save.block_ids) == len(prompt) // BLOCK
    assert save.hashes == [h.hex() for h in req.block_hashes]
    assert kvo.invalid_block_ids == set()
    return save.block_ids

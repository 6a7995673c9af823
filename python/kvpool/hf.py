"""A prefix cache for Hugging Face transformers causal LMs, on kvpool.

:class:`PrefixCache` runs a prompt through a model with the KV of its longest cached prefix
loaded from kvpool instead of computed, and saves the KV of the blocks it computed for the next
request. It is the smallest complete reuse loop (lookup, load, suffix compute, save), for
measuring reuse on a real model and for proving that what comes back from the pool is the KV the
model would have computed; it is not a serving engine (one sequence at a time, no paging on the
model's side).

Keys. A prompt is cut into ``block_tokens``-token blocks; only full blocks have keys
(docs/HASHING.md, :func:`kvpool.block_hashes`, with the model id, the KV dtype and the layer range
in the seed) and every key starts with the :func:`kvpool.engine.layout_salt` of the model id,
dtype, block size, layer count, KV heads, head dim and byte layout below. The model id defaults
to a fingerprint of the model's config and of a sample of every weight tensor, so two models
(another checkpoint, another random seed, another geometry) never share a key.

Byte layout of one block (``LAYOUT``): one object per block holds every layer's K and V, as the
C-contiguous array ``[num_layers, 2, num_kv_heads, block_tokens, head_dim]`` of the model's dtype
(index 0 of the second axis is K, 1 is V), native byte order: ``num_layers * 2 * num_kv_heads *
block_tokens * head_dim * itemsize`` bytes. The tensors are transformers' own per-layer
``[batch=1, num_kv_heads, seq, head_dim]`` cache tensors cut along ``seq``.

Copies on a load: kvpool copies each block into a registered staging tensor (one copy on the same
host; over TCP the socket read lands there); one ``torch`` copy gathers each layer's K and V out
of the blocks into ``[1, H, n * block_tokens, D]``; transformers' ``DynamicLayer.update``
concatenates it into the cache (a third copy, the price of its public API). On a save: one copy
of the new blocks from the cache into the staging tensor, then kvpool's copy into the pool.

Every kvpool call goes through :class:`kvpool.engine.EngineStore`, so a dead or slow daemon is a
miss and a recompute, never an exception.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import block_hashes
from .engine import EngineStore, layout_salt

#: The name of the byte layout above; part of every key's salt.
LAYOUT = "hf-block-v1:[layers,2,kv_heads,block_tokens,head_dim]"


@dataclass
class PrefillResult:
    """What :meth:`PrefixCache.prefill` returns.

    ``logits``: the model's logits for the computed tokens (``[1, tokens_computed, vocab]``, or
    the last ``logits_to_keep`` of them); ``tokens_loaded`` + ``tokens_computed`` is the prompt's
    length; ``cache``: the ``DynamicCache`` holding the whole prompt's KV (to decode on from);
    ``blocks_saved``: blocks newly stored; ``seconds``: wall time of ``lookup``, ``load`` (pool
    to staging tensor to ``DynamicCache``), ``compute`` (the model on the suffix) and ``save``;
    ``cpu_seconds``: the same phases in this process's CPU time (on a machine whose cores other
    work shares, the measure of work done that the others' load does not inflate).
    """

    logits: torch.Tensor
    tokens_loaded: int
    tokens_computed: int
    cache: DynamicCache
    blocks_saved: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of ``model``'s config and of the first 64 values of every parameter: it tells
    two checkpoints (or two random initialisations) of one architecture apart without hashing
    every weight."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


class PrefixCache:
    """Prefill with the longest cached prefix loaded from kvpool; save the computed blocks.

    ``PrefixCache(store, model, block_tokens=16, model_id=None)``: ``store`` is an
    :class:`EngineStore` (its breaker and deadlines apply to every call), ``model`` a
    transformers causal LM whose decoder uses a full-attention ``DynamicCache`` (Llama, Qwen2,
    Mistral without sliding window, ...), ``model_id`` the name in every key's seed (default:
    :func:`model_fingerprint`). Calls are serialised by a lock; batch size is one.
    """

    def __init__(
        self,
        store: EngineStore,
        model: Any,
        block_tokens: int = 16,
        *,
        model_id: str | None = None,
    ):
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        cfg = model.config.get_text_config(decoder=True)
        kinds = {type(layer) for layer in DynamicCache(config=model.config).layers}
        if kinds - {DynamicLayer}:
            # A sliding-window or linear-attention layer keeps only part of the context (or a
            # state): blocks of full K and V are not what it holds.
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ValueError(
                f"PrefixCache needs full-attention cache layers, not {names}"
            )
        self.store = store
        self.model = model
        self.block_tokens = block_tokens
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.dtype = next(model.parameters()).dtype
        self.model_id = model_id or model_fingerprint(model)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.block_shape = (
            self.num_layers,
            2,
            self.num_kv_heads,
            block_tokens,
            self.head_dim,
        )
        self.block_bytes = self.dtype.itemsize * _prod(self.block_shape)
        self.salt = layout_salt(
            model=self.model_id,
            dtype=self.dtype_name,
            block_tokens=block_tokens,
            layers=self.num_layers,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            layout=LAYOUT,
        ).encode()
        self._staging: torch.Tensor | None = None
        self._lock = threading.Lock()

    # ----- keys -----

    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The keys of the full blocks of ``tokens`` (a partial last block has none)."""
        hashes = block_hashes(
            list(tokens),
            self.block_tokens,
            model=self.model_id,
            dtype=self.dtype_name,
            layer_start=0,
            layer_end=self.num_layers,
            salt=cache_salt,
        )
        return [self.salt + h for h in hashes]

    # ----- the request -----

    @torch.no_grad()
    def prefill(
        self,
        input_ids: Any,
        *,
        cache_salt: str | None = None,
        logits_to_keep: int = 0,
        save: bool = True,
    ) -> PrefillResult:
        """Runs the prompt ``input_ids`` (a sequence of ints, or a ``[T]`` / ``[1, T]`` tensor)
        with its longest cached prefix of full blocks loaded from the pool; at least its last
        token is always computed. ``logits_to_keep``: 0 for the logits of every computed token,
        ``n`` for the last ``n``. ``save``: store the KV of the full blocks the pool lacked.
        ``cache_salt`` isolates users who must not share entries (vLLM's ``cache_salt``)."""
        tokens = _token_list(input_ids)
        if not tokens:
            raise ValueError("an empty prompt has nothing to prefill")
        with self._lock:
            return self._prefill(tokens, cache_salt, logits_to_keep, save)

    def _prefill(
        self, tokens: list[int], cache_salt: str | None, logits_to_keep: int, save: bool
    ) -> PrefillResult:
        bt, n_tokens = self.block_tokens, len(tokens)
        clock = _PhaseClock()
        keys = self.keys(tokens, cache_salt)
        matched = self.store.match_prefix(keys)
        # Keep at least one token to compute: the logits of the last one are the answer.
        usable = min(matched, (n_tokens - 1) // bt)
        clock.end("lookup")

        cache = DynamicCache(config=self.model.config)
        loaded = self._load(keys[:usable], cache) if usable else 0
        clock.end("load")
        # hits + misses = full blocks per request: load() counted its hits and failed loads,
        # these are the blocks the lookup did not offer (or that the last token needs).
        self.store.counters.add(misses=len(keys) - usable)

        start = loaded * bt
        suffix = torch.tensor([tokens[start:]], dtype=torch.long)
        out = self.model(
            input_ids=suffix,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        clock.end("compute")

        first_new = max(matched, loaded)
        saved = self._save(keys, first_new, cache) if save else 0
        clock.end("save")
        return PrefillResult(
            logits=out.logits,
            tokens_loaded=start,
            tokens_computed=n_tokens - start,
            cache=cache,
            blocks_saved=saved,
            seconds=clock.wall,
            cpu_seconds=clock.cpu,
        )

    # ----- loads and saves -----

    def _staging_blocks(self, n: int) -> torch.Tensor:
        """A registered tensor of at least ``n`` blocks (grown by doubling)."""
        if self._staging is None or self._staging.shape[0] < n:
            if self._staging is not None:
                self.store.unregister(self._staging.data_ptr())
            cap = max(n, 2 * (0 if self._staging is None else self._staging.shape[0]))
            self._staging = torch.empty((cap, *self.block_shape), dtype=self.dtype)
            self.store.register(self._staging.data_ptr(), self._staging.nbytes)
        return self._staging

    def _load(self, keys: list[bytes], cache: DynamicCache) -> int:
        """Loads the blocks of ``keys`` and puts the leading run that arrived into ``cache``;
        how many blocks that is."""
        n = len(keys)
        staging = self._staging_blocks(n)
        base, size = staging.data_ptr(), self.block_bytes
        ok = self.store.load(keys, [base + i * size for i in range(n)], [size] * n)
        run = 0
        while run < n and ok[run]:
            run += 1
        if run == 0:
            return 0
        h, d, t = self.num_kv_heads, self.head_dim, run * self.block_tokens
        for layer in range(self.num_layers):
            # [run, H, bt, D] -> [1, H, run * bt, D]: the one gather copy.
            k = staging[:run, layer, 0].transpose(0, 1).reshape(1, h, t, d)
            v = staging[:run, layer, 1].transpose(0, 1).reshape(1, h, t, d)
            cache.update(k, v, layer)
        return run

    def _save(self, keys: list[bytes], first: int, cache: DynamicCache) -> int:
        """Stores blocks ``first..len(keys)`` of ``cache``; how many were stored."""
        n = len(keys) - first
        if n <= 0:
            return 0
        staging = self._staging_blocks(n)
        bt, h, d = self.block_tokens, self.num_kv_heads, self.head_dim
        lo, hi = first * bt, len(keys) * bt
        for layer, cached in enumerate(cache.layers[: self.num_layers]):
            for j, src in enumerate((cached.keys, cached.values)):
                blocks = src[0, :, lo:hi].reshape(h, n, bt, d).transpose(0, 1)
                staging[:n, layer, j].copy_(blocks)
        base, size = staging.data_ptr(), self.block_bytes
        ok = self.store.save(
            keys[first:], [base + i * size for i in range(n)], [size] * n
        )
        return sum(ok)

    def close(self) -> None:
        """Unregisters the staging tensor (the store stays open: it is the caller's)."""
        with self._lock:
            if self._staging is not None:
                self.store.unregister(self._staging.data_ptr())
                self._staging = None


class _PhaseClock:
    """Wall and process CPU time of consecutive phases."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._t = (time.perf_counter(), time.process_time())

    def end(self, phase: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall[phase] = now[0] - self._t[0]
        self.cpu[phase] = now[1] - self._t[1]
        self._t = now


def _token_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError("PrefixCache prefills one sequence at a time")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError("input_ids must be [T] or [1, T]")
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out

"""How the SGLang backend keeps every exception from SGLang's storage threads: a guard that
turns a failed call into the miss each call answers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.hicache_storage import PoolTransfer

if TYPE_CHECKING:
    from .sglang import KvpoolStore


def _guarded(miss: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Turns any exception of a public method into ``miss(*args)``, counted and logged once
    per method (then at debug level)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: KvpoolStore, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 (SGLang's threads must only see a miss)
                self._guard_failed(fn.__name__, e)
                try:
                    return miss(*args, **kwargs)
                except Exception:  # noqa: BLE001 (malformed arguments: the emptiest miss)
                    return miss()

        return wrapper

    return deco


def _n_keys(keys: Sequence[Any] | None = None, *_: Any, **__: Any) -> int:
    try:
        return len(keys) if keys is not None else 0
    except TypeError:
        return 0


def _all_false(*args: Any, **kwargs: Any) -> list[bool]:
    return [False] * _n_keys(*args, **kwargs)


def _per_pool_false(
    transfers: Sequence[PoolTransfer] | None = None, *_: Any, **__: Any
) -> dict[str, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


def _batch_get_miss(
    keys: Sequence[Any] | None = None,
    target_locations: Any = None,
    target_sizes: Any = None,
) -> list[None] | int:
    if target_locations is not None and target_sizes is not None:
        return 0
    return [None] * _n_keys(keys)

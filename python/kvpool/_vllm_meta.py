"""What both sides of the vLLM connector share: the work the scheduler sends the workers, the
guard that keeps every exception from vLLM, and a spec's page size."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from .vllm import KvpoolConnector

log = logging.getLogger("kvpool.vllm")

T = TypeVar("T")


def guarded(
    default: Callable[[], Any],
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Runs a connector method so that no exception reaches vLLM: on any error the method
    answers ``default()`` (a miss) and the error is logged (the first one as a warning)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(self: KvpoolConnector, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 (vLLM must only ever see a miss)
                self._note_error(fn.__name__, e)
                return default()

        return run

    return wrap


def page_bytes(spec: Any) -> int:
    """Bytes of one block of one layer, without the padding some specs add for alignment (the
    per-layer views vLLM hands over exclude it)."""
    return int(getattr(spec, "unpadded_page_size_bytes", spec.page_size_bytes))


# ----- what the scheduler sends the workers -----


@dataclass
class BlockJob:
    """Blocks of one request to move: ``block_ids[i]`` holds the block whose vLLM hash is
    ``hashes[i]`` (hex)."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: loads (with ``load_async``: the request waits for
    them) and saves of blocks that became full this step."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    load_async: bool = True

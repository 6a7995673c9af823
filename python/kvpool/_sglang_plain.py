"""The SGLang backend's plain interface: SGLang's generic path without ``interface_v1``, one
flat value per page, into tensors or Mooncake-style pointers."""

from __future__ import annotations

from typing import Any

import torch

from ._sglang_guard import _batch_get_miss, _guarded


def _tensor_bytes(t: torch.Tensor, writable: bool = False) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 CPU tensor: a view of ``t`` to write into (which
    must then be a contiguous CPU tensor), or its bytes to read (a copy where needed)."""
    if writable:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("kvpool: a get target must be a contiguous CPU tensor")
        return t.reshape(-1).view(torch.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


class PlainInterface:
    """``KvpoolStore``'s plain calls (mixed into it)."""

    @_guarded(lambda *a, **k: None)
    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> Any:
        """The value of ``key``: into ``target_location`` when it is a CPU tensor (the tensor,
        or None); into registered memory when it is a pointer with ``target_sizes`` bytes
        (True, or False); as a new uint8 tensor without a target (or None)."""
        pk = self._plain_key(key)
        if isinstance(target_location, torch.Tensor):
            view = _tensor_bytes(target_location, writable=True)
            got = self.store.get_many_into([pk], [view.numpy()])
            expect = target_location.numel() * target_location.element_size()
            return target_location if got[0] == expect else None
        if target_location is not None:
            ptr, size = self._pointer(target_location, target_sizes)
            return self.store.load([pk], [ptr], [size])[0]
        v = self.store.get(pk)
        return None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)

    @_guarded(_batch_get_miss)
    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None] | int:
        """``get`` for many keys in one round trip. Tensors (SGLang's generic path): the list
        of filled tensors or None. Pointers with sizes (Mooncake's form): how many leading
        keys were loaded."""
        if not keys:
            return []
        pks = [self._plain_key(k) for k in keys]
        if target_sizes is not None and target_locations is not None:
            ptrs = [self._pointer(p, s) for p, s in zip(target_locations, target_sizes)]
            ok = self.store.load(pks, [p for p, _ in ptrs], [s for _, s in ptrs])
            return ok.index(False) if False in ok else len(ok)
        if target_locations is None:
            return [self.get(k) for k in keys]
        views = [_tensor_bytes(t, writable=True) for t in target_locations]
        got = self.store.get_many_into(pks, [v.numpy() for v in views])
        return [
            t if g == v.numel() else None
            for t, v, g in zip(target_locations, views, got)
        ]

    @_guarded(lambda *a, **k: False)
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Stores a tensor (or any buffer) ``value``, or ``target_sizes`` bytes of registered
        memory at ``target_location``, under ``key``; True when stored or already there."""
        if value is None and target_location is None:
            return False
        return self.batch_set(
            [key],
            None if value is None else [value],
            None if target_location is None else [target_location],
            None if target_sizes is None else [target_sizes],
        )

    @_guarded(lambda *a, **k: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """``set`` for many keys (one presence and one store round trip); True when every
        key is stored. MLA ranks that are not the storage writer put nothing."""
        if not keys:
            return False
        if self.is_mla and not self.is_writer:
            return True
        pks = [self._plain_key(k) for k in keys]
        present = self.store.presence(pks)
        todo = [i for i, p in enumerate(present) if not p]
        if not todo:
            return True
        if values is not None:
            bufs = [
                _tensor_bytes(values[i]).numpy()
                if isinstance(values[i], torch.Tensor)
                else values[i]
                for i in todo
            ]
            return self.store.put_many([pks[i] for i in todo], bufs)
        if target_locations is None or target_sizes is None:
            return False
        ptrs = [self._pointer(target_locations[i], target_sizes[i]) for i in todo]
        ok = self.store.save(
            [pks[i] for i in todo], [p for p, _ in ptrs], [s for _, s in ptrs]
        )
        return all(ok)

    @staticmethod
    def _pointer(location: Any, size: Any) -> tuple[int, int]:
        """(pointer, size) from Mooncake's plain forms: an int or a one-element list each."""
        if isinstance(location, (list, tuple)):
            if len(location) != 1:
                raise ValueError("kvpool: one contiguous buffer per key")
            location = location[0]
        if isinstance(size, (list, tuple)):
            size = sum(size)
        ptr, n = int(location), int(size)
        if ptr <= 0 or n <= 0:
            raise ValueError("kvpool: a null pointer or an empty size")
        return ptr, n

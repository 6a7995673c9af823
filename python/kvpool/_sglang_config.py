"""The SGLang backend's settings: the ``extra_config`` keys it reads, their defaults and their
checks, and the byte order of each host layout's objects."""

from __future__ import annotations

import os
from typing import Any

#: ``extra_config`` keys this backend reads, with their defaults (docs/ENGINES.md).
CONFIG_DEFAULTS: dict[str, Any] = {
    "kvpool_url": None,  # or $KVPOOL_URL
    "kvpool_namespace": None,  # kvpoold's "default"
    "kvpool_token": None,
    "lookup_timeout_ms": 5.0,
    "io_timeout_ms": 2000.0,
    "failure_threshold": 3,
    "probe_interval_s": 5.0,
    "kvpool_same_host": True,  # False: every byte over the socket, as from another host
}

#: Host layouts by the byte order of their objects (the salt's ``order`` field).
BYTE_ORDER = {
    "page_first": "token-major",
    "layer_first": "layer-major",
    "page_first_direct": "layer-major",
}


def _parse_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The backend's settings from ``extra_config``; raises ValueError on a bad one."""
    unknown = [k for k in extra if k.startswith("kvpool_") and k not in CONFIG_DEFAULTS]
    if unknown:
        raise ValueError(
            f"unknown kvpool extra_config keys {unknown}; known: {sorted(CONFIG_DEFAULTS)}"
        )
    cfg = dict(CONFIG_DEFAULTS)
    cfg.update({k: extra[k] for k in CONFIG_DEFAULTS if k in extra})
    url = cfg["kvpool_url"] or os.environ.get("KVPOOL_URL")
    if not isinstance(url, str) or not url:
        raise ValueError(
            "kvpool: set kvpool_url in --hicache-storage-backend-extra-config "
            "(or KVPOOL_URL), e.g. tcp://127.0.0.1:7070"
        )
    cfg["kvpool_url"] = url
    for k in ("lookup_timeout_ms", "io_timeout_ms", "probe_interval_s"):
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"kvpool: {k} must be a positive number, got {v!r}")
    ft = cfg["failure_threshold"]
    if isinstance(ft, bool) or not isinstance(ft, int) or ft < 1:
        raise ValueError(
            f"kvpool: failure_threshold must be an integer >= 1, got {ft!r}"
        )
    for k in ("kvpool_namespace", "kvpool_token"):
        if cfg[k] is not None and not isinstance(cfg[k], str):
            raise ValueError(f"kvpool: {k} must be a string")
    if type(cfg["kvpool_same_host"]) is not bool:  # ValueError, as for every bad key
        raise ValueError("kvpool: kvpool_same_host must be true or false")
    return cfg

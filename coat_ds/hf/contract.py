"""transformers' decoder-layer contract where it differs between the releases coat_ds supports.

The KV cache reaches a decoder layer as `past_key_values` up to transformers 5.23 and as `cache` from 5.24
(which keeps the old name as a deprecated alias on HF's own layers). A layer that reads
one spelling silently ignores the cache under the other: cached decoding then attends to the new
tokens alone."""
from __future__ import annotations

from typing import Any

CACHE_ARGS = ("cache", "past_key_values")


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """The KV cache passed under either name (None if neither), removed from `kwargs`."""
    found = [kwargs.pop(name, None) for name in CACHE_ARGS]
    return next((c for c in found if c is not None), None)


def has_cache(kwargs: dict[str, Any]) -> bool:
    return any(kwargs.get(name) is not None for name in CACHE_ARGS)

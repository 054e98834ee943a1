"""The one wording of an unknown config key, and of a value outside a key's choices, for every section coat_ds
reads (the "coat" section, its "activation" and "loss", CoatAdamW's optimizer.params, DeepSpeed's own sections as
check_config validates them), so that a user meets one form wherever the typo is."""
from __future__ import annotations

from typing import Iterable


def unknown_key(path: str, key: object, allowed: Iterable[str]) -> str:
    """`coat.activation.modes: unknown key; allowed keys: [...]`."""
    return f"{path}.{key}: unknown key; allowed keys: {list(allowed)}"


def check_choice(path: str, value: object, allowed: Iterable) -> object:
    """`value` if it is one of `allowed`, else `ValueError: coat.states='cpu' is invalid; allowed: [...]`."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{path}={value!r} is invalid; allowed: {allowed}")
    return value

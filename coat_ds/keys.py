"""The one wording of an unknown config key, for every section coat_ds reads (the "coat" section, its
"activation" and "loss", CoatAdamW's optimizer.params, DeepSpeed's own sections as check_config validates them),
so that a user meets one form wherever the typo is."""
from __future__ import annotations

from typing import Iterable


def unknown_key(path: str, key: object, allowed: Iterable[str]) -> str:
    """`coat.activation.modes: unknown key; allowed keys: [...]`."""
    return f"{path}.{key}: unknown key; allowed keys: {list(allowed)}"

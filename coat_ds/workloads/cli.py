"""What the example scripts share on the command line: one-line refusals and the DeepSpeed JSON they read."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn


def refuse(message: str) -> NoReturn:
    """`error: <message>` once, from rank 0, and exit 2. For bad input found before torch.distributed is up,
    so the launcher's RANK says which process speaks; every rank finds the same fault and exits."""
    if os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def read_ds_config(path: str) -> dict:
    """The JSON object in `path`, else refuse()."""
    if not Path(path).is_file():
        refuse(f"--deepspeed {path}: no such file (ready configs: ds_configs/*.json)")
    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        refuse(f"--deepspeed {path}: not valid JSON ({e})")
    if not isinstance(cfg, dict):
        refuse(f"--deepspeed {path}: the top level must be a JSON object")
    return cfg


def check_ds_config(cfg: dict, hf_auto: bool = False) -> dict:
    """`cfg` if DeepSpeed and coat_ds will accept it (coat_ds.deepspeed.check_config), else refuse() with the
    key and what is allowed. `hf_auto`: "auto" values are HF Trainer's to fill."""
    from coat_ds.deepspeed.check import check_config

    try:
        check_config(cfg, hf_auto=hf_auto)
    except ValueError as e:
        refuse(str(e))
    return cfg

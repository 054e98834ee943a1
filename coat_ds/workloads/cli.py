"""What the example scripts share on the command line: one-line refusals and the DeepSpeed JSON they read.

One exit code per kind of failure, its line said once, on a line of its own:

    2   the job's input refused before it starts (flags, the config, --data, --model, the checkpoint to resume):
        refuse(); every rank finds the same fault, rank 0 says it
    1   a failure while the job runs (a save, a non-finite loss, a lost rank: coat_ds.launch.watchdog): fail();
        said by rank 0 where every rank knows it, else by the rank that failed
    128 + N   stopped by signal N, after its checkpoint
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

EXIT_INPUT, EXIT_FAILED = 2, 1


def _rank_zero() -> bool:
    """Whether this process speaks for every rank: the launcher's RANK (torch.distributed may not be up yet)."""
    return os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0"


def say(line: str) -> None:
    """`line` on stderr on a line of its own, also where a progress bar holds the current one: on a terminal the
    bar is cleared and drawn again below it (tqdm.write); in a log, a newline ends the bar's line first."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    stream = sys.stderr
    if tqdm is not None and stream.isatty():
        tqdm.write(line, file=stream)
    else:
        bar = tqdm is not None and any(not getattr(b, "disable", True) for b in list(getattr(tqdm, "_instances", ())))
        stream.write(("\n" if bar else "") + line + "\n")
    stream.flush()


def refuse(message: str) -> NoReturn:
    """`error: <message>` once, from rank 0, and exit 2. For bad input found before the job runs (before
    torch.distributed is up, so the launcher's RANK says which process speaks); every rank finds the same fault."""
    if _rank_zero():
        say(f"error: {message}")
    raise SystemExit(EXIT_INPUT)


def fail(message: str, *, mine: bool = False) -> NoReturn:
    """`error: <message>` once and exit 1: a failure while the job runs. Rank 0 says one that every rank knows
    alike; with `mine`, this rank says its own (a failure only it saw)."""
    if mine or _rank_zero():
        say(f"error: {message}")
    raise SystemExit(EXIT_FAILED)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are refuse()'s: one line from rank 0, exit 2 (argparse's own prints usage on every
    rank)."""

    def error(self, message: str) -> NoReturn:
        refuse(message)


def check_model(model: str | None) -> None:
    """--model: a folder, or a name for the HF hub ('gpt2', 'org/name'). A path that is not a folder is said as such;
    HF would take it for a hub id and say "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    if model is None or os.path.isdir(model):
        return
    if os.path.exists(model):
        refuse(f"--model {model}: not a directory; allowed: an HF model folder (config.json, weights) or a hub id "
               "such as 'org/name'")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or model.endswith("/"):
        refuse(f"--model {model}: no such directory; allowed: an HF model folder (config.json, weights; --export "
               "writes one) or a hub id such as 'org/name'")


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


def check_sp_size(sp_size: int, heads: int, kv_heads: int, seq_len: int, world: int | None = None) -> None:
    """--sp-size (Ulysses sequence parallelism), before any model memory: refuse() in one line naming the key and
    the sizes allowed where it does not divide the world size (the launcher's WORLD_SIZE unless given), the
    model's attention heads (its key/value heads: divides or is a multiple of them) or --seq-len."""
    from coat_ds.deepspeed.sequence_parallel import refusal

    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    why = refusal(sp_size, world, heads, kv_heads, seq_len)
    if why is not None:
        refuse(why)

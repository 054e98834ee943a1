"""The measured tables, one module per benchmark family, and what they share: the registry `benchmarks.render_tables`
renders from, the JSON reader, the cells. A table is a function of the results folder, decorated with @table, that
yields its header, then its rows."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator

RESULTS = Path(__file__).resolve().parents[1] / "results"
Table = Callable[[Path], Iterator[list]]
TABLES: dict[str, Table] = {}


class NotYet(Exception):
    """Raised by a table whose JSON no device call has written yet: its region shows one row naming the command."""

    def __init__(self, command: str, section: str):
        super().__init__(f"not measured yet: `python -m benchmarks.{command}` (docs/benchmarks.md, \"{section}\")")


def table(fn: Table) -> Table:
    TABLES[fn.__name__] = fn
    return fn


def headline(name: str, *first: object) -> None:
    """Registers `{name}_headline`: the one row of table `name` whose first cells start with `first` (the README
    shows it; the full table stays in docs/), so the README's figure is the full table's, re-rendered with it."""
    def pick(res: Path):
        rows = TABLES[name](res)
        yield next(rows)
        found = [r for r in rows if all(str(c).startswith(str(f)) for c, f in zip(r, first))]
        if len(found) != 1:
            raise ValueError(f"{name}_headline: {len(found)} rows of {name} start with {first}, not 1")
        yield found[0]
    TABLES[f"{name}_headline"] = pick


def load(results: Path, name: str, section: str | None = None):
    """results/`name`; with `section` (of docs/benchmarks.md), NotYet where no device call has written it yet."""
    if section and not (results / name).is_file():
        raise NotYet(name.removesuffix(".json"), section)
    return json.loads((results / name).read_text())


def num(x, digits: int = 1) -> str:
    """A figure as printed: fixed digits, thousands separated; '-' for none."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def gpu(device: str) -> str:
    return device.split("x ")[-1].replace("NVIDIA ", "")   # '2x NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3'


def tokens(rung: dict | None) -> str:
    return num(rung and rung["tokens_per_s"], 0)


def peaks(rung: dict) -> str:
    return f"{num(rung['peak_alloc_gb'])} / {num(rung['peak_reserved_gb'])}"   # GiB allocated / reserved


def configs(run: dict) -> dict:
    return {c["name"]: c for c in run["configs"]}

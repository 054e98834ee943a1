"""Renders the measured tables of README.md and docs/*.md from benchmarks/results/*.json.

    python -m benchmarks.render_tables           # rewrite every marked region
    python -m benchmarks.render_tables --check   # exit 1 naming each region that differs (tests/test_render_tables.py)

A region is `<!-- table:NAME -->` ... `<!-- /table -->` in a Markdown file; NAME is a table of benchmarks/tables/
(a function decorated with @table there, or a `NAME_headline` row of one). This module splices; the tables render.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from benchmarks.tables import RESULTS, TABLES, NotYet, markdown, num  # noqa: F401  (num: the scripts' cells)
from benchmarks.tables import accuracy, e2e, kernels, one_gpu, scaling  # noqa: F401  (each registers its tables)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGION = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render(name: str, results: Path = RESULTS) -> str:
    """The table's Markdown; one 'not measured yet' row where its JSON is not written yet."""
    rows = TABLES[name](results)
    header = next(rows)
    try:
        body = list(rows)
    except NotYet as e:
        body = [[str(e), *["-"] * (len(header) - 1)]]
    return markdown(header, body)


def regions(text: str) -> list[tuple[str, str]]:
    """(name, current body) of every marked region of a Markdown text."""
    return [(m.group(2), m.group(3)) for m in REGION.finditer(text)]


def rewrite(text: str, results: Path = RESULTS) -> str:
    return REGION.sub(lambda m: m.group(1) + render(m.group(2), results) + m.group(4), text)


def stale(results: Path = RESULTS, files: list[Path] = DOCS) -> list[str]:
    """'file: table' for every region whose text is not what its JSON renders (or names no table)."""
    return [f"{path.relative_to(ROOT)}: {name}" for path in files for name, body in regions(path.read_text())
            if name not in TABLES or body != render(name, results)]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        for line in bad:
            print(f"{line}: differs from benchmarks/results; run python -m benchmarks.render_tables")
        return 1 if bad else 0
    for path in DOCS:
        text = path.read_text()
        if REGION.search(text):
            path.write_text(rewrite(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

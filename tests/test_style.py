"""The project's style rule that a reader can check: no Python function over 60 lines in the package, the
examples or the benchmarks (a longer one is split into named steps with one job each)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60


def long_functions(root: Path, base: Path = ROOT, max_lines: int = MAX_LINES) -> list[str]:
    """`path:line name (n lines)` (path relative to `base`) for every function or method under `root` longer
    than `max_lines`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > max_lines:
                    found.append(f"{path.relative_to(base)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_long_functions_are_found(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * MAX_LINES + "\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path, base=tmp_path) == [f"m.py:1 f ({MAX_LINES + 1} lines)"]


def test_no_function_over_60_lines():
    found = [f for d in ("coat_ds", "examples", "benchmarks") for f in long_functions(ROOT / d)]
    assert not found, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(found)

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


# The rooms of docs/architecture.md, bottom up: a module imports coat_ds only from its own room or a lower one
# (optim and activation share a level and do not import each other), and DeepSpeed / transformers only
# from the rooms that own that knowledge.
LEVELS = {"formats": 0, "kernels": 1, "optim": 2, "activation": 2, "hf": 3, "deepspeed": 4, "workloads": 5}
TOP = 6                                            # coat_ds/__init__.py, report.py: the package's front door
OWNERS = {"deepspeed": {"deepspeed", "workloads"}, "transformers": {"hf", "deepspeed", "workloads"}}


def _room(parts: tuple[str, ...]) -> str:
    return parts[1] if len(parts) > 2 else ""      # coat_ds/<room>/<module>.py; "" for coat_ds/<module>.py


def _imports(path: Path, package: tuple[str, ...]):
    """(module names imported, absolute) for every import in path; relative imports resolved against package."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            yield name
            if not node.module:                    # from .. import kernels: the names are modules
                yield from (f"{name}.{alias.name}" for alias in node.names)


def layering_violations(root: Path = ROOT / "coat_ds") -> list[str]:
    """`path: imports X` (path relative to root's parent) for every import that points up the rooms or takes a
    library its room does not own."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        room = _room(parts)
        level = LEVELS.get(room, TOP)
        for name in _imports(path, parts[:-1]):
            top, *rest = name.split(".")
            if top == "coat_ds" and rest:
                other = rest[0] if rest[0] in LEVELS else ""
                other_level = LEVELS.get(other, TOP)
                if other and other != room and (other_level > level or (other_level == level and room)):
                    found.append(f"{path.relative_to(root.parent)}: imports {name}")
            elif top in OWNERS and room not in OWNERS[top] and level != TOP:
                found.append(f"{path.relative_to(root.parent)}: imports {name}")
    return found


def test_layering_violations_are_found(tmp_path):
    kernels = tmp_path / "coat_ds" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "m.py").write_text("from ..optim import CoatAdamW\nfrom . import loader\nimport deepspeed\n")
    (kernels / "ok.py").write_text("from ..formats import fp8\nimport torch\n")
    assert layering_violations(tmp_path / "coat_ds") == [
        "coat_ds/kernels/m.py: imports coat_ds.optim", "coat_ds/kernels/m.py: imports deepspeed"]


def test_imports_follow_the_rooms():
    found = layering_violations()
    assert not found, "imports against docs/architecture.md's rooms:\n" + "\n".join(found)

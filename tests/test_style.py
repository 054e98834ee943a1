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
    found = [f for d in ("coat_ds", "examples", "benchmarks", "data") for f in long_functions(ROOT / d)]
    assert not found, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(found)


# The rooms of docs/architecture.md, bottom up: a module imports coat_ds only from its own room or a lower one
# (optim and activation share a level and do not import each other), and DeepSpeed / transformers only
# from the rooms that own that knowledge.
LEVELS = {"launch": 0, "formats": 0, "kernels": 1, "optim": 2, "activation": 2, "hf": 3, "deepspeed": 4, "workloads": 5}
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


def _from_names(path: Path) -> set[str]:
    """The names of every `from X import name` in path: a name may be a module of package X."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}


def import_circles(roots: tuple[str, ...] = ("coat_ds", "benchmarks", "examples", "data"),
                   base: Path = ROOT) -> list[str]:
    """`a -> b -> ... -> a` for each circle of imports between the repository's modules (imports inside functions
    count: a circle there is one module's job split in two). A package's __init__ re-exporting its modules is
    not a circle: only edges to modules, not to packages, are followed."""
    modules = {}
    for path in (p for r in roots if (base / r).is_dir() for p in sorted((base / r).rglob("*.py"))):
        parts = path.relative_to(base).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = path.relative_to(base).with_suffix("").parts[:-1]
        names = set(_imports(path, package))
        froms = _from_names(path)   # once a file, not once an imported name (1,020 parses of 121 files took ~4 s)
        names |= {f"{n}.{a}" for n in list(names) for a in froms}  # from benchmarks import plot_utils
        targets = {n for n in names if n in modules and n != name}
        graph[name] = {t for t in targets if modules[t].name != "__init__.py"}
    found, done = [], set()
    for start in sorted(graph):                # each circle once, from its smallest module
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(" -> ".join(trail + [start]))
                elif nxt > start and nxt not in trail and nxt not in done:
                    stack.append((nxt, trail + [nxt]))
        done.add(start)
    return found


def test_import_circles_are_found(tmp_path):
    pkg = tmp_path / "coat_ds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert import_circles(("coat_ds",), base=tmp_path) == ["coat_ds.a -> coat_ds.b -> coat_ds.a"]


def test_no_import_circles():
    found = import_circles()
    assert not found, "modules that import each other (one job split in two; merge or move the shared part):\n" \
        + "\n".join(found)

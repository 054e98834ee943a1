"""The versions CI installs (.ci/constraints.txt) and the ranges setup.py admits, read from one place each.

    python .ci/versions.py freeze < <(pip freeze --all --exclude-editable)   # a passing venv -> constraints
    python .ci/versions.py lowest                                            # setup.py's lower bounds, as ==
    python .ci/versions.py pin torch                                         # one line of the constraints

`.ci/setup` and `.ci/drift` call it; tests/test_versions.py checks that the constraints satisfy setup.py.
Only the standard library and `packaging` (pip's own copy where the venv has none yet)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh venv: pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
EXTRAS = ("dev",)          # what .ci/setup installs besides install_requires (`pip install -e ".[dev]"`)
NOT_PINNED = {"pip"}       # the venv's own installer, from the Python that made it
HEADER = """\
# What CI last passed with: `.ci/setup` passes this file with -c to every pip install, so a fresh clone
# installs these versions. Regenerate from a venv that passed `bash .ci/run` (see docs/versions.md):
#   . .venv/bin/activate && python .ci/versions.py freeze < <(pip freeze --all --exclude-editable) > .ci/constraints.txt
# tests/test_versions.py checks every pin against setup.py's ranges.
"""


def requirements() -> list[Requirement]:
    """setup.py's install_requires and the EXTRAS it names, read from its source (nothing runs, nothing builds)."""
    call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    extras = ast.literal_eval(kw["extras_require"])
    names = ast.literal_eval(kw["install_requires"]) + [r for e in EXTRAS for r in extras[e]]
    return [Requirement(n) for n in names]


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path}: '{line}' is not name==version"
            out[canonicalize_name(name)] = version
    return out


def disagreements(pinned: dict[str, str]) -> list[str]:
    """What keeps `pinned` from being an install setup.py admits: a requirement left unpinned or pinned outside
    its range."""
    out = []
    for r in requirements():
        version = pinned.get(canonicalize_name(r.name))
        if version is None:
            out.append(f"{r.name}: not pinned (setup.py: {r})")
        elif not r.specifier.contains(version, prereleases=True):
            out.append(f"{r.name}=={version}: outside setup.py's {r}")
    return out


def lowest() -> list[str]:
    """`name==X` for every `>=X` bound in setup.py: the oldest versions it admits."""
    return [f"{r.name}=={s.version}" for r in requirements() for s in r.specifier if s.operator == ">="]


def freeze(lines: list[str]) -> str:
    """The constraints file from `pip freeze --all --exclude-editable` lines: local labels (+cpu) dropped, so
    the pin also matches the same release from PyPI."""
    body = [ln.split("+")[0] for ln in lines if "==" in ln and canonicalize_name(ln.split("==")[0]) not in NOT_PINNED]
    return HEADER + "\n".join(sorted(body, key=lambda ln: canonicalize_name(ln.split("==")[0]))) + "\n"


def main(argv: list[str]) -> None:
    if argv[:1] == ["freeze"]:
        sys.stdout.write(freeze(sys.stdin.read().splitlines()))
    elif argv[:1] == ["lowest"]:
        print("\n".join(lowest()))
    elif argv[:1] == ["pin"] and len(argv) == 2:
        name = canonicalize_name(argv[1])
        print(f"{name}=={pins()[name]}")
    else:
        sys.exit("usage: versions.py freeze | lowest | pin NAME")


if __name__ == "__main__":
    main(sys.argv[1:])

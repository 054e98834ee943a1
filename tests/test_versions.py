"""The versions CI pins (.ci/constraints.txt) and the ranges setup.py admits cannot drift apart silently: every
package setup.py asks for is pinned, every pin is inside its range, and setup.py admits exactly the DeepSpeed releases
whose internals coat_ds/deepspeed/fence.py records (docs/versions.md)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ci_versions", ROOT / ".ci" / "versions.py")
versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(versions)
_spec = importlib.util.spec_from_file_location("fence", ROOT / "coat_ds" / "deepspeed" / "fence.py")  # stdlib only
fence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fence)


def test_constraints_agree_with_setup_py():
    assert not versions.disagreements(versions.pins()), versions.disagreements(versions.pins())


def test_a_pin_outside_its_range_or_missing_is_caught(tmp_path):
    """The check above can fail: transformers a major release below setup.py's bound, deepspeed left out."""
    pins = versions.pins()
    (bound,) = [s.version for r in versions.requirements() if r.name == "transformers" for s in r.specifier
                if s.operator == ">="]
    older = f"{int(bound.split('.')[0]) - 1}.0.0"
    lines = [f"{name}=={older if name == 'transformers' else v}  # why" for name, v in pins.items()
             if name != "deepspeed"]
    (tmp_path / "c.txt").write_text("# a comment\n" + "\n".join(lines) + "\n")
    found = versions.disagreements(versions.pins(tmp_path / "c.txt"))
    assert len(found) == 2 and found[0].startswith("deepspeed: not pinned"), found
    assert found[1].startswith(f"transformers=={older}: outside"), found


def test_lowest_is_each_lower_bound_and_freeze_drops_local_labels():
    lowest = dict(line.split("==") for line in versions.lowest())
    bounds = {r.name: s.version for r in versions.requirements() for s in r.specifier if s.operator == ">="}
    assert lowest == bounds and {"torch", "deepspeed", "transformers"} <= set(lowest)
    frozen = versions.freeze(["torch==2.13.0+cpu", "pip==23.2.1", "# Editable install", "Jinja2==3.1.6"])
    assert frozen.startswith(versions.HEADER) and frozen.endswith("\nJinja2==3.1.6\ntorch==2.13.0\n")


def test_setup_py_admits_exactly_the_fenced_deepspeed_releases():
    """From the oldest tested release to the newest, nothing newer (its next patch release is refused), and CI pins a
    tested one."""
    from packaging.version import Version

    (spec,) = [r.specifier for r in versions.requirements() if r.name == "deepspeed"]
    tested = sorted(fence.TESTED, key=Version)
    newest = Version(tested[-1])
    assert [s.version for s in spec if s.operator == ">="] == [tested[0]], spec
    assert all(spec.contains(v) for v in tested), (spec, tested)
    assert not spec.contains(f"{newest.major}.{newest.minor}.{newest.micro + 1}"), spec
    assert versions.pins()["deepspeed"] in fence.TESTED


def test_drift_runs_test_files_that_exist():
    """.ci/drift's default selection names files; one merged away or renamed would make the check run nothing."""
    text = (ROOT / ".ci" / "drift").read_text()
    names = re.findall(r"tests/[\w/]+\.py", text[text.index("tests=("):])
    assert len(names) >= 10, names
    assert [n for n in names if not (ROOT / n).is_file()] == []

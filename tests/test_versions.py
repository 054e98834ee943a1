"""The versions CI pins (.ci/constraints.txt) and the ranges setup.py admits cannot drift apart silently: every
package setup.py asks for is pinned, and every pin is inside its range (docs/versions.md)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ci_versions", ROOT / ".ci" / "versions.py")
versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(versions)


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

"""The wheel installs coat_ds alone (its op builders and kernel sources inside it), and a fresh venv outside the
checkout JIT-builds the CPU op from the installed files and passes the kernel-vs-reference tests with it.

~1-2 min: the op builds from scratch in its own TORCH_EXTENSIONS_DIR (`-m "not install"` leaves it out)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.install

PROBE = """
import json, coat_ds
from coat_ds import op_builder
op = op_builder.CPUCoatAdamBuilder().load()
print(json.dumps({"coat_ds": coat_ds.__file__, "csrc": op_builder.builder.CSRC_DIR, "op": op.__file__}))
"""


def _run(cmd: list, **kw) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _checkout_files() -> list[str]:
    """What a fresh clone of this checkout would hold: tracked and new (not ignored) files and links."""
    names = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).split("\0")
    return [n for n in names if (ROOT / n).is_file() or (ROOT / n).is_symlink()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the checkout (so a stale build/ there cannot leak into it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in _checkout_files():
        (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp / "src" / name, follow_symlinks=False)  # coat_ds/op_builder, coat_ds/csrc
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", tmp / "src",
          "-w", tmp / "dist"])
    return next((tmp / "dist").glob("coat_ds-*.whl"))


def _fresh_venv(where: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new venv that sees this environment's packages (torch, deepspeed, pytest)
    through a .pth line, which does not run their .pth files: the checkout's editable coat_ds stays unseen."""
    _run([sys.executable, "-m", "venv", "--without-pip", where])
    python = where / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def test_wheel_holds_only_coat_ds(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"coat_ds", dist_info}
    files = [n for n in _checkout_files() if not (ROOT / n).is_symlink()]
    wanted = {f"coat_ds/{n}" for n in files if n.startswith("csrc/")}
    wanted |= {f"coat_ds/{n}" for n in files if n.startswith("op_builder/") and n.endswith(".py")}
    assert wanted and wanted <= names, sorted(wanted - names)


@pytest.mark.slow
def test_installed_wheel_builds_and_runs_cpu_op(wheel, tmp_path):
    python, site = _fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COAT_DISABLE_OPS")}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONNOUSERSITE="1",
               PATH=os.pathsep.join([str(python.parent), os.path.dirname(sys.executable), env.get("PATH", "")]))
    facts = json.loads(_run([python, "-c", PROBE], cwd=tmp_path, env=env).splitlines()[-1])
    site = site.resolve()
    assert Path(facts["coat_ds"]).resolve() == site / "coat_ds" / "__init__.py"
    assert Path(facts["csrc"]).resolve() == site / "coat_ds" / "csrc"
    assert Path(facts["op"]).resolve().is_relative_to((tmp_path / "ext").resolve())  # built here, just now
    assert not (site / "op_builder").exists() and not (site / "csrc").exists()
    # the kernel tests, run in that venv: they import the installed coat_ds and load the op it built
    _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", ROOT / "tests" / "test_kernels_adam.py",
          "-k", "cpu_adam_step_matches_reference"], cwd=tmp_path, env=env)

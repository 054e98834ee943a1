"""What the tests that start other processes share: a free port, the environment a child needs to import this
checkout, the launchers' paths, a job script run as a world of one, and a launched job's JSON result."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT / --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict:
    """os.environ with this checkout first on PYTHONPATH (children import it, not the editable install) and the data
    cache of the examples kept in the checkout; `extra` added."""
    env = dict(os.environ, **extra)
    env.setdefault("COAT_DATA_CACHE", str(ROOT / ".cache" / "coat_data"))   # BPE + tokens built once per checkout
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def launcher(name: str = "deepspeed") -> str:
    """The path of a launcher script (`deepspeed`, `accelerate`): on PATH, else beside this Python."""
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def run_one_rank_job(tmp_path: Path, source: str) -> dict:
    """Run a job script (`source`) as a world of one without a launcher; what it printed last after "RESULT "."""
    script = tmp_path / "job.py"
    script.write_text(source)
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def launch_json(cmd: list[str], out: Path, env: dict | None = None, timeout: int = 600, exit_0: bool = True) -> dict:
    """Run a launcher command whose job writes its results to the JSON file `out`; the test fails with the log's
    tail where it writes none or (`exit_0`) exits with another status."""
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)
    if (exit_0 and proc.returncode != 0) or not Path(out).is_file():
        pytest.fail(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(Path(out).read_text())

"""The built wheel works where users install it: a fresh venv outside the repository, run from an
empty directory with an empty HOME. `keyexpiry demo` and `keyexpiry bench --quick` find all they
need inside the package, and no generic top-level `tasks` or `bench` package is installed."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SQLITE = ["--backend", "sqlite", "--no-peers"]


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, (
        f"{cmd[:3]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@pytest.mark.timeout(900)
def test_the_wheel_runs_demo_and_bench_from_an_empty_directory(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KEYEXPIRY_")}
    _run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(dist)],
        cwd=tmp_path,
        env=base_env,
        timeout_s=300,
    )
    (wheel,) = dist.glob("keyexpiry-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"keyexpiry"}, tops
    assert "keyexpiry/examples/orders.py" in names and "keyexpiry/bench/run.py" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=base_env, timeout_s=120)
    _run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        cwd=tmp_path,
        env=base_env,
        timeout_s=600,
    )
    empty = tmp_path / "empty"
    home = tmp_path / "home"
    empty.mkdir()
    home.mkdir()
    env = {**base_env, "HOME": str(home), "XDG_STATE_HOME": str(home / ".state")}
    env.pop("PYTHONPATH", None)
    keyexpiry = str(venv / "bin" / "keyexpiry")

    demo = _run([keyexpiry, "demo"], cwd=empty, env=env, timeout_s=180)
    assert "OrderTimeout" in demo, demo[-2000:]

    bench = _run(
        [keyexpiry, "bench", "--quick", "--scenario", "create", "--runs", "1", *SQLITE],
        cwd=empty,
        env=env,
        timeout_s=300,
    )
    assert "single_per_s" in bench and "figures written to" in bench, bench[-2000:]
    assert (empty / "bench-results" / "latest.json").exists()

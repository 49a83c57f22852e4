"""The built wheel works where users install it: a fresh venv outside the repository, run from an
empty directory with an empty HOME. `keyexpiry demo` and `keyexpiry bench --quick` find all they
need inside the package, and no generic top-level `tasks` or `bench` package is installed.

The wheel is built from a copy of the source tree: setuptools packs whatever an earlier build left
in `build/lib` (a module since deleted, a top-level `bench/` from before the move) into the wheel,
and the test must neither depend on nor write to the developer's checkout. Every process the
commands start has its files (and, for the venv's programs, its executable) under `tmp_path`;
whatever is still running afterwards is killed, and fails the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SQLITE = ["--backend", "sqlite", "--no-peers"]
# What a checkout holds besides the source: never part of a build.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
    ".state", "bench-results",
)  # fmt: skip
# `bench --scenario create` starts no listener: this small wave runs one, as
# `python -m keyexpiry listen --tasks keyexpiry.bench.tasks` from the installed package.
WAVE = """
from keyexpiry.bench import harness, scenarios
with harness.servers(with_mariadb=False) as srv:
    got = scenarios.due_wave(
        srv, srv.fresh("sqlite"), driver=True, n=20, span_s=0.5, cap_s=30, lead_s=1
    )
print(f"fired {got['fired']} of {got['n']}")
"""


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, (
        f"{cmd[:3]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _kill_processes_under(path: Path) -> list[str]:
    """Kill the processes whose command line names something under `path`; describe them."""
    prefix = f"{path}{os.sep}"
    found = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(prefix in part for part in p.info["cmdline"] or ())
    ]
    described = []
    for proc in found:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid}: {' '.join(proc.cmdline())[:300]}")
            proc.kill()
    psutil.wait_procs(found, timeout=10)
    return described


def _build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    dist = tmp_path / "dist"
    # -v: the build backend's own output, where setuptools prints its warnings.
    log = _run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-v", "-w", str(dist)],
        cwd=tmp_path,
        env=env,
        timeout_s=180,
    )
    warned = [
        line
        for line in log.splitlines()
        if "Warning" in line or "deprecated" in line.lower() or "absent from" in line
    ]
    assert not warned, "\n".join(warned)
    (wheel,) = dist.glob("keyexpiry-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"keyexpiry"}, tops
    for module in ("examples/orders.py", "examples/schema.py", "bench/run.py", "bench/tasks.py"):
        assert f"keyexpiry/{module}" in names
    for data in ("web/templates/base.html", "web/static/dashboard.css", "py.typed"):
        assert f"keyexpiry/{data}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: MIT" in zipfile.ZipFile(wheel).read(metadata).decode()
    return wheel


@pytest.mark.xdist_group("heavy")
@pytest.mark.timeout(600)
def test_the_wheel_runs_demo_and_bench_from_an_empty_directory(tmp_path: Path) -> None:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KEYEXPIRY_")}
    base_env.pop("PYTHONPATH", None)
    try:
        wheel = _build_wheel(tmp_path, base_env)
        venv = tmp_path / "venv"
        _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=base_env, timeout_s=120)
        _run(
            [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
            cwd=tmp_path,
            env=base_env,
            timeout_s=300,
        )
        empty, home, tmp = tmp_path / "empty", tmp_path / "home", tmp_path / "tmp"
        for d in (empty, home, tmp):
            d.mkdir()
        # TMPDIR: the demo's state dir and the bench's servers live under tmp_path too.
        env = {**base_env, "HOME": str(home), "TMPDIR": str(tmp)}
        env.pop("XDG_STATE_HOME", None)
        keyexpiry = str(venv / "bin" / "keyexpiry")

        version = _run([keyexpiry, "--version"], cwd=empty, env=env, timeout_s=60)
        assert version.strip() == "keyexpiry 0.1.0", version
        demo = _run([keyexpiry, "demo"], cwd=empty, env=env, timeout_s=120)
        assert "OrderTimeout@close_unpaid@218" in demo and "business data now" in demo, demo

        bench = _run(
            [keyexpiry, "bench", "--quick", "--scenario", "create", "--runs", "1", *SQLITE],
            cwd=empty,
            env=env,
            timeout_s=180,
        )
        header = next(line for line in bench.splitlines() if line.startswith("scenario "))
        assert header.split() == [
            "scenario", "single_per_s", "single_wall_us", "single_client_cpu_us",
            "single_redis_cpu_us", "single_waiting_us", "bulk_per_s", "redis_bytes_per_task",
        ]  # fmt: skip
        assert "figures written to" in bench, bench
        assert (empty / "bench-results" / "latest.json").exists()

        wave = _run([str(venv / "bin" / "python"), "-c", WAVE], cwd=empty, env=env, timeout_s=120)
        assert "fired 20 of 20" in wave, wave
        assert sorted(p.name for p in empty.iterdir()) == ["bench-results"]
    finally:
        leftovers = _kill_processes_under(tmp_path)
    assert not leftovers, f"still running after the commands exited: {leftovers}"

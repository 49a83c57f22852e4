"""What a command imports: every CLI call and every listener's start pays for its imports, so
the heavy parts load only when used (the web, the bench, the ORM, the database drivers...).
What they cost is measured by the bench, not asserted here: these say which modules load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HEAVY_FOR_HELP = (
    "sqlalchemy",
    "redis",
    "starlette",
    "jinja2",
    "uvicorn",
    "opentelemetry",
    "cronsim",
    "matplotlib",
    "psycopg",
    "pymysql",
    "prometheus_client",
    "keyexpiry.client",
    "keyexpiry.ledger",
    "keyexpiry.listener",
    "keyexpiry.web",
    "keyexpiry.bench",
)
"""Not one of these for `keyexpiry --help` (it took 1.2 s with them, 0.25 s without)."""

NOT_FOR_A_LISTENER = (
    "starlette",
    "jinja2",
    "uvicorn",
    "matplotlib",
    "sqlalchemy.orm",
    "keyexpiry.web",
    "keyexpiry.bench",
    "keyexpiry.ops.endpoints",
)
"""A listener without --http serves no dashboard, draws no plot and takes no ORM Session."""


_PROBE = """
import atexit, runpy, sys
out, code, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv = ["keyexpiry", *argv]
exec(code) if code else runpy.run_module("keyexpiry", run_name="__main__")
"""


def imported(tmp_path: Path, *argv: str, code: str = "") -> set[str]:
    """The modules in `sys.modules` when a fresh interpreter that ran `code` (or else
    `keyexpiry argv...`) exits (`-X importtime` misses those `importlib` imports)."""
    out = tmp_path / "modules.txt"
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), code, *argv],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KEYEXPIRY_")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    modules = set(out.read_text().splitlines())
    assert "keyexpiry" in modules, result.stderr[-2000:]
    return modules


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.mark.parametrize("argv", [["--help"], ["listen", "--help"]])
def test_help_imports_none_of_the_heavy_parts(argv: list[str], tmp_path: Path) -> None:
    assert _loaded(imported(tmp_path, *argv), HEAVY_FOR_HELP) == []


def test_the_public_names_import_on_first_use(tmp_path: Path) -> None:
    modules = imported(
        tmp_path, code="import keyexpiry; from keyexpiry import ConfigError, Settings"
    )
    assert _loaded(modules, HEAVY_FOR_HELP) == []
    modules = imported(tmp_path, code="from keyexpiry import Client, Listener")
    assert {"keyexpiry.client", "keyexpiry.listener.listener"} <= modules


def test_a_listener_imports_neither_the_web_nor_the_bench_nor_the_orm(tmp_path: Path) -> None:
    modules = imported(tmp_path, code="import keyexpiry.cli, keyexpiry.listener.listener")
    assert _loaded(modules, NOT_FOR_A_LISTENER) == []

"""README and Makefile say what the code does: every CLI option is in README's command table, the
demo installs only what runs, and a clone can be installed without a package index. No servers."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from keyexpiry.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# README's command table: one row per command, the command and its options in the first cell.
ROWS = [line for line in README.splitlines() if line.startswith("| `keyexpiry ")]
# Options every task-naming command shares, described once under the table.
SHARED = {"--tasks", "--help"}


def _commands(cmd: Any, path: list[str]) -> Iterator[tuple[str, Any]]:
    # Duck-typed: typer may bring a click of its own, whose Group is not click's.
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield " ".join(["keyexpiry", *path]), cmd


COMMANDS = sorted(_commands(typer.main.get_command(app), []), key=lambda pair: pair[0])


@pytest.mark.parametrize("name,cmd", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_cli_option_is_in_the_readme_table(name: str, cmd: Any) -> None:
    # A command's row starts with it, or names it among alternatives (`schedule pause|resume`).
    words = name.split()
    pattern = re.compile(
        r"^\| `" + re.escape(" ".join(words[:-1])) + r" (?:[\w-]+\\?\|)*" + re.escape(words[-1])
        + r"(?:\\?\|[\w-]+)*[ `]"
    )  # fmt: skip
    rows = [row for row in ROWS if pattern.match(row)]
    assert rows, f"README's command table has no row for `{name}`"
    cell = " ".join(row.split(" | ")[0] for row in rows)
    missing = [
        opt
        for param in cmd.params
        for opt in param.opts
        if opt.startswith("--") and opt not in SHARED and opt not in cell
    ]
    assert not missing, f"`{name}`'s row in README does not mention {missing}"


def test_readme_names_the_shared_options() -> None:
    for opt in SHARED - {"--help"}:
        assert f"`{opt}" in README, opt


def _make_n(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -B: every recipe, as on a fresh clone with no venv yet.
    out = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout


def test_make_demo_installs_what_runs_not_the_test_extras() -> None:
    recipe = _make_n("demo")
    assert "pip install -q -e ." in recipe
    assert "[test]" not in recipe and "keyexpiry demo" in recipe


def test_make_dist_builds_a_wheel_and_readme_says_how_to_install_it() -> None:
    assert "pip wheel" in _make_n("dist")
    assert "make dist" in README
    # Not on a package index yet: README must not tell users to install it from one.
    assert not re.search(r"pip install keyexpiry(?![\[\w/.-])", README)


def test_reliability_shows_the_soak_section_as_make_reliability_builds_it() -> None:
    # An edit of docs/RELIABILITY.md's soak section itself is lost at the next `make
    # reliability`; hand-written text goes in docs/soak/hours.md, which the build keeps.
    from tests.reliability import SOAK_DIR, _soak_section

    section = "\n".join(_soak_section()).strip()
    assert section in (ROOT / "docs" / "RELIABILITY.md").read_text()
    hours = (SOAK_DIR / "hours.md").read_text().strip()
    assert section.split("\n\n")[1] == hours.split("\n\n")[0]

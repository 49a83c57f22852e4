"""examples/django_shop's own pytest-django tests, run as a user runs them (`pytest` in its
directory), on SQLite, MariaDB and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHOP = Path(__file__).resolve().parents[2] / "examples" / "django_shop"


def test_the_shop_example_passes_its_tests(db_url: str, redis_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEYEXPIRY_", "DJANGO_"))}
    env |= {
        "SHOP_DATABASE_URL": db_url,
        "SHOP_REDIS_URL": redis_url,
        "SHOP_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(SHOP.parents[1]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=SHOP,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "3 passed" in run.stdout

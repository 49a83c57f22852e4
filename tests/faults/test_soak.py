"""The soak end to end, shortened: a minute of load with the whole fault rotation, judged from
its history (`keyexpiry bench --scenario soak` runs the same thing for `--minutes`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from keyexpiry.bench import soak
from keyexpiry.bench.soak_redis import CLUSTER_FAULTS, SENTINEL_FAULTS
from tests.conftest import _require, _require_postgres

pytestmark = pytest.mark.faults

TOPOLOGIES = ("sentinel-mariadb", "sentinel-postgres", "cluster-mariadb", "sentinel-patroni")
"""Redis and ledger of the short soak: one per run, `KEYEXPIRY_TEST_SOAK_TOPOLOGY` or the
commit's choice."""


def soak_topology() -> str:
    """The topology this run's short soak uses (its test id names it): KEYEXPIRY_TEST_SOAK_TOPOLOGY
    when set, else the checked-out commit chooses, so successive commits soak each and a rerun of
    one commit soaks the same one (every xdist worker must collect the same test)."""
    if chosen := os.environ.get("KEYEXPIRY_TEST_SOAK_TOPOLOGY"):
        return chosen
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return TOPOLOGIES[int(head[:8], 16) % len(TOPOLOGIES)]
    except (OSError, ValueError, subprocess.SubprocessError):
        return TOPOLOGIES[0]  # not a git checkout


@pytest.mark.xdist_group("heavy")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("topology", [soak_topology()])
def test_a_short_soak_loses_nothing_through_every_fault(tmp_path: Path, topology: str) -> None:
    redis_kind, _, ledger = topology.partition("-")
    if redis_kind == "sentinel":
        _require("haproxy")
    if ledger in ("postgres", "patroni"):
        _require_postgres()
    if ledger == "patroni":
        _require("patroni")
        _require("etcd")
    cfg = soak.SoakConfig(
        ledger=ledger,
        redis=redis_kind,
        # Patroni's faults take a leader key's lifetime and a rejoin: room for all of them.
        minutes=1.2 if ledger != "patroni" else 1.5,
        rate_per_s=200,
        max_due_s=15.0,
        fault_every_s=8.0,
        warm_up_s=20.0,
        sample_every_s=4.0,
        sigstop_s=6.0,
        stall_s=5.0,
    )
    report = soak.run(cfg, tmp_path, say=print)
    verdict = report["verdict"]
    # Growth needs minutes of samples after the warm-up (the 30-minute run in
    # docs/RELIABILITY.md judges it); a minute judges what happened to each task.
    failures = [f for f in verdict["failures"] if " grew " not in f]
    assert not failures, soak.summary(report)
    fates = {name: f["count"] for name, f in verdict["fates"].items()}
    for bad in ("lost", "ran_twice_undocumented", "ran_after_cancel", "dead_short"):
        assert fates.get(bad, 0) == 0, soak.summary(report)
    assert verdict["early"]["starts"] == 0
    run_dir = Path(report["run_dir"])
    # Every fault of the rotation happened, with its start and end logged.
    faults = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    rotation = list(CLUSTER_FAULTS if redis_kind == "cluster" else SENTINEL_FAULTS)
    if ledger == "patroni":
        i = rotation.index("ledger_restart")
        rotation[i : i + 1] = soak.PATRONI_FAULTS
    assert {f["fault"] for f in faults} == set(rotation), faults
    # A fault that raised says "fault failed: …" (`soak.py`); "Sentinel failed over again" is a
    # failover that happened twice, not a failure.
    assert all(
        f["end_ms"] >= f["start_ms"] and not f["detail"].startswith("fault failed") for f in faults
    ), faults
    assert [f["fault"] for f in faults].count("flushall") == 1
    assert fates["ran_once"] > 0.9 * verdict["created"], fates
    assert fates["dead_by_design"] > 0 and fates["cancelled"] > 0, fates
    assert verdict["created_by_via"].keys() == {"plain", "tag", "tx"}
    # The killed listener came back as a new process; every listener was sampled.
    listeners = [
        json.loads(line) for line in (run_dir / "listeners.jsonl").read_text().splitlines()
    ]
    assert any(line.get("returncode") == -9 for line in listeners)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(len(s["listeners"]) == cfg.listeners for s in samples[1:])
    assert all(Path(p).stat().st_size > 10_000 for p in report["plots"])
    written = json.loads((run_dir / "soak.json").read_text())
    assert written["verdict"]["created"] == verdict["created"]

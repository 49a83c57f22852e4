"""The benchmark's parts that need no server: its table, and what it does without the server
binaries."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from keyexpiry.bench import cpuquota, harness
from keyexpiry.bench.run import format_table
from keyexpiry.errors import ConfigError
from keyexpiry.redis.embedded import redis_binary


def _report(scenarios: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    return {
        "runs": 1,
        "backend": "sqlite",
        "scenarios": {
            name: {variant: {"median": m} for variant, m in variants.items()}
            for name, variants in scenarios.items()
        },
    }


def test_table_headers_are_apart_and_stand_over_their_values_however_wide() -> None:
    wave = {"late_p50_ms": 3.0, "late_max_ms": 123456789.0, "fired": 2000, "tasks_per_s": 997.5}
    table = format_table(
        _report(
            {
                "steady": {"driver=on": wave, "driver=off": {"late_p50_ms": 713.0, "fired": 20}},
                "create": {"default": {"single_per_s": 1711, "redis_bytes_per_task": 165.4}},
            }
        )
    ).splitlines()
    assert table[0] == "medians of 1 run(s), backend sqlite"
    header, on, off, create = table[1:]
    heads = header.split()
    # Only the columns some row has, named apart (no `tasks_per_slistener_cpu_s`).
    assert heads == [
        "scenario",
        "p50",
        "max",
        "fired",
        "tasks_per_s",
        "single_per_s",
        "redis_bytes_per_task",
    ]
    assert on.split() == ["steady", "driver=on", "3.0", "123456789.0", "2000", "997.5"]

    def right_edge(line: str, text: str) -> int:
        return line.index(text) + len(text)

    for head, line, value in [
        ("p50", on, "3.0"),
        ("p50", off, "713.0"),
        ("max", on, "123456789.0"),
        ("fired", off, "20"),
        ("tasks_per_s", on, "997.5"),
        ("single_per_s", create, "1711"),
        ("redis_bytes_per_task", create, "165.4"),
    ]:
        assert right_edge(line, f" {value}") == right_edge(header, f" {head}"), (head, value)


def test_the_mariadb_backend_without_its_binaries_is_one_error_before_any_server_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(harness, "find_binary", lambda name: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where servers() puts its workdir
    with (
        pytest.raises(ConfigError, match=r"mariadbd and mariadb-install-db .* --backend sqlite"),
        harness.servers(with_mariadb=True),
    ):
        pass
    assert list(tmp_path.iterdir()) == []


def test_without_a_system_redis_server_the_bundled_one_is_used_and_described(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "find_binary", lambda name: None)
    assert harness.redis_server_binary() == redis_binary()
    figures = harness.machine()
    assert figures["redis"].startswith("v=") and figures["mariadb"] == "-"


@pytest.mark.skipif(
    cpuquota.unavailable() is not None, reason=str(cpuquota.unavailable())
)  # root with a cgroup cpu controller (CI and the dev machines have both)
def test_a_cpu_quota_holds_a_busy_process_to_its_share() -> None:
    import subprocess
    import sys
    import time

    import psutil

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    quota = cpuquota.CpuQuota(0.2)
    try:
        quota.add(busy.pid)
        proc = psutil.Process(busy.pid)
        start_cpu, start = sum(proc.cpu_times()[:2]), time.monotonic()
        deadline = start + 1.5
        while time.monotonic() < deadline:
            time.sleep(0.1)
        used = (sum(proc.cpu_times()[:2]) - start_cpu) / (time.monotonic() - start)
        assert used < 0.35, used  # unlimited, a busy loop takes a whole core
        assert quota.throttled_s() > 0
    finally:
        busy.kill()
        busy.wait()
        quota.remove()
    assert not quota.path.exists()


def test_the_aio_scenario_runs_async_drivers_only_on_mariadb() -> None:
    from keyexpiry.bench import aio

    threads = ["sync", "threads=4", "threads=8", "threads=16"]
    assert aio.variants("sqlite") == threads
    natives = aio.variants("mariadb")[len(threads) :]
    assert natives == [f"native={d}" for d in aio.native_drivers("mariadb")]
    assert set(aio.native_drivers("mariadb")) <= {"aiomysql", "asyncmy"}


def test_churns_verdict_compares_the_peak_after_warm_up_with_the_size_at_its_end() -> None:
    from keyexpiry.bench.churn import verdict

    grown = [{"s": 0, "bytes": 10}, {"s": 300, "bytes": 100}, {"s": 600, "bytes": 160}]
    assert verdict(grown, minutes=15) == {
        "warm_up_s": 300, "bytes_at_warm_up": 100, "bytes_peak_after": 160,
        "bytes_at_end": 160, "peak_over_warm_up": 1.6, "ok": False,
    }  # fmt: skip
    # The growth before the warm-up's end (retention not deleting yet) does not count.
    steady = [{"s": 0, "bytes": 10}, {"s": 60, "bytes": 90}, {"s": 120, "bytes": 100}]
    assert verdict(steady, minutes=3) == {
        "warm_up_s": 60, "bytes_at_warm_up": 90, "bytes_peak_after": 100,
        "bytes_at_end": 100, "peak_over_warm_up": 1.11, "ok": True,
    }  # fmt: skip


def test_each_run_carries_the_machines_pace_around_it() -> None:
    from keyexpiry.bench.run import _runs

    calls: list[int] = []

    def wave() -> dict[str, Any]:
        calls.append(1)
        return {"tasks_per_s": 100.0 * len(calls)}

    got = _runs("wave", 3, wave)
    assert [r["tasks_per_s"] for r in got["runs"]] == [100.0, 200.0, 300.0]
    assert all(r["probe_cpu_ms"] > 0 for r in got["runs"])
    assert got["median"]["probe_cpu_ms"] > 0

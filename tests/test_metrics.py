"""RunMetrics: what the workers queue becomes Prometheus counters and histograms (pure logic)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from keyexpiry.run_metrics import RunMetrics


def scrape(metrics: RunMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_nothing_is_kept_until_enabled() -> None:
    m = RunMetrics()
    m.started("A.b", 5)
    m.ended("A.b", "done", 0.01)
    assert not any(name.startswith("keyexpiry_runs") for name, _ in scrape(m))


def test_observations_become_counts_and_cumulative_buckets() -> None:
    m = RunMetrics()
    m.enabled = True
    m.declare(["A.b"])
    for late_ms in (0, 2, 2, 40, 7_200_000):  # the last one is beyond the 1 h bucket
        m.started("A.b", late_ms)
    m.ended("A.b", "done", 0.002)
    m.ended("A.b", "dead", 0.5)
    got = scrape(m)
    task = (("task", "A.b"),)
    assert got[("keyexpiry_runs_total", (("outcome", "done"), *task))] == 1
    assert got[("keyexpiry_runs_total", (("outcome", "dead"), *task))] == 1
    assert got[("keyexpiry_runs_total", (("outcome", "timeout"), *task))] == 0  # declared
    bucket = "keyexpiry_lateness_seconds_bucket"
    assert got[(bucket, (("le", "0.001"), *task))] == 1
    assert got[(bucket, (("le", "0.0025"), *task))] == 3
    assert got[(bucket, (("le", "0.05"), *task))] == 4
    assert got[(bucket, (("le", "3600.0"), *task))] == 4
    assert got[(bucket, (("le", "+Inf"), *task))] == 5
    assert got[("keyexpiry_lateness_seconds_count", task)] == 5
    assert abs(got[("keyexpiry_lateness_seconds_sum", task)] - 7200.044) < 1e-6
    assert got[("keyexpiry_handler_seconds_count", task)] == 2


def test_concurrent_workers_lose_no_observation() -> None:
    m = RunMetrics()
    m.enabled = True
    m._FOLD_AT = 500  # fold often, from the workers themselves

    def work() -> None:
        for _ in range(5000):
            m.started("A.b", 1)
            m.ended("A.b", "done", 0.001)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = scrape(m)
    assert got[("keyexpiry_runs_total", (("outcome", "done"), ("task", "A.b")))] == 40_000
    assert got[("keyexpiry_lateness_seconds_count", (("task", "A.b"),))] == 40_000

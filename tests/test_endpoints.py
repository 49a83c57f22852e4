"""`listen --http`: Prometheus /metrics, /healthz and /readyz against real servers."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import MariaDBServer, wait_until
from keyexpiry.errors import ConfigError
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.ops.endpoints import Endpoints, HttpLimits, parse_bind
from keyexpiry.ops.metrics import NAMES
from tests import sample_tasks
from tests.conftest import MariaDBFactory, RedisFactory
from tests.ke import Running, make_settings, wait_status

StartListener = Callable[[Settings], Running]


def get(url: str, timeout_s: float = 5) -> tuple[int, str]:
    """Status and body of a GET (errors included)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page by (name, sorted labels)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def base(running: Running) -> str:
    endpoints = running.listener.endpoints
    assert endpoints is not None
    return f"http://127.0.0.1:{endpoints.port}"


def test_metrics_count_runs_by_outcome_lateness_and_the_ledger(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    running = start_listener(settings.replace(http="127.0.0.1:0"))
    url = base(running)
    done = [client.create(sample_tasks.Probe.record, f"m{i}", ttl_ms=50) for i in range(5)]
    dead = client.create(sample_tasks.Probe.always_fail, "x", ttl_ms=50)
    later = [client.create(sample_tasks.Probe.record, f"later{i}", ttl_s=600) for i in range(3)]
    client.create(sample_tasks.Probe.record, "tomorrow", ttl_s=3 * 86400)
    for key in done:
        wait_status(client, key, TaskStatus.DONE)
    wait_status(client, dead, TaskStatus.DEAD)
    assert len(later) == 3

    # Every run ended: no worker is still counted busy (a worker counts itself out as it asks
    # for its next run, just after its outcome is queued), none waits.
    wait_until(lambda: samples(get(f"{url}/metrics")[1])[("keyexpiry_workers_active", ())] == 0, 10)
    status, body = get(f"{url}/metrics")
    assert status == 200
    m = samples(body)
    assert m[("keyexpiry_runs_waiting", ())] == 0
    record = (("task", "Probe.record"),)
    fail = (("task", "Probe.always_fail"),)
    assert m[("keyexpiry_runs_total", (("outcome", "done"), *record))] == 5
    # always_fail has two retries: three runs, the last one dead
    assert m[("keyexpiry_runs_total", (("outcome", "retry"), *fail))] == 2
    assert m[("keyexpiry_runs_total", (("outcome", "dead"), *fail))] == 1
    assert m[("keyexpiry_lateness_seconds_count", record)] == 5
    assert m[("keyexpiry_handler_seconds_count", fail)] == 3
    # lateness is real: every run started after its due time, within the 1 h top bucket
    assert m[("keyexpiry_lateness_seconds_bucket", (("le", "3600.0"), *record))] == 5
    assert m[("keyexpiry_claims_total", (("result", "won"),))] >= 8
    assert m[("keyexpiry_events_total", (("kind", "expired"),))] >= 6
    assert m[("keyexpiry_tasks", (("status", "pending"),))] == 4
    assert m[("keyexpiry_tasks", (("status", "dead"),))] == 1
    assert m[("keyexpiry_pending", (("window", "1h"),))] == 3
    assert m[("keyexpiry_pending", (("window", "later"),))] == 1
    assert m[("keyexpiry_overdue", ())] == 0
    assert m[("keyexpiry_ready", ())] == 1
    assert m[("keyexpiry_ledger_up", ())] == 1
    served = {name for name, _ in m} | {f.name for f in text_string_to_metric_families(body)}
    missing = [n for n in NAMES if n not in served and n.removesuffix("_total") not in served]
    assert not missing, f"documented but not served: {missing}"


def test_healthz_and_unknown_paths(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    url = base(start_listener(settings.replace(http="127.0.0.1:0")))
    # Before any run, every outcome series of every registered task is there at 0, so an
    # alert on increase() sees the first dead run.
    m = samples(get(f"{url}/metrics")[1])
    assert m[("keyexpiry_runs_total", (("outcome", "dead"), ("task", "Probe.broken")))] == 0
    assert get(f"{url}/healthz") == (200, "ok\n")
    assert get(f"{url}/readyz") == (200, "ready\n")
    assert get(f"{url}/nope")[0] == 404


def test_bad_or_taken_http_addresses_are_refused_in_one_line(
    settings: Settings, client: Client
) -> None:
    for bad in ("localhost", "host:port", "1.2.3.4:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            settings.replace(http=bad)
    assert parse_bind(":9464") == ("0.0.0.0", 9464)
    assert parse_bind("[::1]:9464") == ("::1", 9464)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        from keyexpiry.listener.listener import Listener

        listener = Listener(settings.replace(http=f"127.0.0.1:{port}"))
        try:
            with pytest.raises(ConfigError, match="cannot listen"):
                listener.serve_http()
        finally:
            listener.rt.close()


def test_readyz_follows_redis_going_away_and_back(
    redis_factory: RedisFactory, sqlite_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    server = redis_factory()
    cfg = make_settings(server.url(0), sqlite_url, tmp_path, http="127.0.0.1:0")
    sample_tasks.reset()
    url = base(start_listener(cfg))
    assert get(f"{url}/readyz")[0] == 200
    server.kill()
    wait_until(lambda: get(f"{url}/readyz")[0] == 503, 10, message="readyz stayed 200")
    status, body = get(f"{url}/readyz")
    assert status == 503 and "Redis" in body, body
    assert get(f"{url}/healthz")[0] == 200  # alive, just not ready
    server.start()
    wait_until(lambda: get(f"{url}/readyz")[0] == 200, 15, message="readyz never came back")


def test_readyz_follows_the_ledger_going_away_and_back(
    mariadb_factory: MariaDBFactory, redis_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    db = mariadb_factory()
    cfg = make_settings(redis_url, db.create_database("ready"), tmp_path, http="127.0.0.1:0")
    sample_tasks.reset()
    url = base(start_listener(cfg))
    assert get(f"{url}/readyz")[0] == 200
    db.stop()
    # The first 503 may name the heartbeat (written every 0.x s) before the ledger probe (its
    # answer is reused for up to a second) names the ledger itself.
    wait_until(lambda: "ledger:" in get(f"{url}/readyz")[1], 10, message="ledger not named")
    assert get(f"{url}/readyz")[0] == 503
    m = samples(get(f"{url}/metrics")[1])
    assert m[("keyexpiry_ready", ())] == 0
    db.start()
    wait_until(lambda: get(f"{url}/readyz")[0] == 200, 15, message="readyz never came back")


@pytest.fixture
def ledger_to_hang(
    mariadb_factory: MariaDBFactory, redis_url: str, tmp_path: Path, start_listener: StartListener
) -> Iterator[tuple[Running, MariaDBServer]]:
    """A listener on a MariaDB ledger of its own, for the test to `pause()` (SIGSTOP: its
    connections stay open, nothing answers); resumed before the listener stops."""
    db = mariadb_factory()
    cfg = make_settings(redis_url, db.create_database("hung"), tmp_path)
    sample_tasks.reset()
    try:
        yield start_listener(cfg), db
    finally:
        db.resume()


def served(limits: HttpLimits, running: Running) -> Endpoints:
    """Endpoints with `limits` for the running listener, serving (the test stops them)."""
    endpoints = Endpoints(running.listener, "127.0.0.1:0", limits)
    endpoints.start()
    return endpoints


def test_healthz_answers_while_a_hung_ledger_meets_a_storm_of_probes(
    ledger_to_hang: tuple[Running, MariaDBServer],
) -> None:
    """Every /readyz and /metrics used to wait on the ledger with a lock held: behind a hung
    database their threads piled up until each slot was taken, and every new connection,
    /healthz's included, was refused."""
    running, db = ledger_to_hang
    endpoints = served(HttpLimits(max_connections=8), running)
    url = f"http://127.0.0.1:{endpoints.port}"
    assert get(f"{url}/readyz")[0] == 200
    stop = threading.Event()
    answers: list[int] = []
    failures: list[str] = []

    def storm(path: str) -> None:
        while not stop.is_set():
            try:
                answers.append(get(url + path)[0])
            except OSError as exc:
                failures.append(f"{path}: {exc!r}")

    db.pause()
    storms = [threading.Thread(target=storm, args=(p,)) for p in ("/readyz", "/metrics") * 3]
    for thread in storms:
        thread.start()
    try:
        wait_until(lambda: "ledger:" in get(f"{url}/readyz")[1], 10, message="ledger not named")
        for _ in range(20):
            started = time.monotonic()
            assert get(f"{url}/healthz") == (200, "ok\n")
            assert time.monotonic() - started < 2.0, "/healthz was slow behind the ledger"
        assert endpoints.busy <= endpoints.limits.max_connections
    finally:
        stop.set()
        for thread in storms:
            thread.join(30)
        endpoints.stop()
    assert not failures, failures[:5]  # no /readyz or /metrics was refused or left hanging
    assert answers.count(503) > 10


def test_healthz_has_a_slot_when_every_other_waits_on_the_ledger(
    ledger_to_hang: tuple[Running, MariaDBServer],
) -> None:
    """Requests waiting on a ledger query (here up to 30 s) take every slot: /healthz gets one
    kept for it, and a /metrics beyond the slots is answered 503 at once."""
    running, db = ledger_to_hang
    limits = HttpLimits(max_connections=2, ledger_wait_s=30)
    endpoints = served(limits, running)
    url = f"http://127.0.0.1:{endpoints.port}"
    db.pause()
    waiting: list[tuple[int, str]] = []
    probes = [
        threading.Thread(target=lambda: waiting.append(get(f"{url}/readyz", timeout_s=60)))
        for _ in range(2)
    ]
    for thread in probes:
        thread.start()
    try:
        wait_until(lambda: endpoints.busy == 2, 10, message="the probes never took the slots")
        started = time.monotonic()
        assert get(f"{url}/healthz") == (200, "ok\n")
        assert get(f"{url}/metrics")[0] == 503
        assert time.monotonic() - started < 2.0
        assert not waiting, "the probes did not wait on the ledger"
    finally:
        db.resume()
        for thread in probes:
            thread.join(30)
        endpoints.stop()
    assert len(waiting) == 2  # answered once the ledger answered


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_connection_no_thread_can_serve_is_a_warning(
    settings: Settings,
    client: Client,
    start_listener: StartListener,
    log_lines: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread that cannot start is the listener's problem, not a client that went away."""
    url = base(start_listener(settings.replace(http="127.0.0.1:0")))

    def no_thread(*_: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(socketserver.ThreadingMixIn, "process_request", no_thread)
    with pytest.raises(OSError):
        get(f"{url}/healthz")
    wait_until(
        lambda: any("can't start new thread" in line for line in log_lines),
        5,
        message=f"not logged at INFO or above: {log_lines}",
    )
    line = next(line for line in log_lines if "can't start new thread" in line)
    assert "WARNING" in line, line
    monkeypatch.undo()
    assert get(f"{url}/healthz") == (200, "ok\n")

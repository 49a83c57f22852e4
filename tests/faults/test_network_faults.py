"""Network faults as Jepsen makes them: a listener in a network namespace of its own, its packets
to Redis or to the ledger dropped (a partition), or delayed 200 ms ± 100 ms with 5 % lost.

The listener in the namespace is a real process on the real servers (`servers.netns`); its
peer runs in this process. Each scenario ends with the verdict, and with the cut listener
ready again and running its share.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.servers import free_port, wait_until
from keyexpiry.bench.servers.netns import NetNamespace, available
from tests import sample_tasks
from tests.conftest import RedisFactory
from tests.faults.spawn import Spawned
from tests.faults.test_process_faults import RunsFile
from tests.ke import Running, make_settings
from tests.reliability import Verdict

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(available() is not None, reason=f"{available()}"),
]
SHARE_TAKEN_S = 10.0
"""From the cut, by when the peer has run the cut listener's share: a listener that cannot beat is
taken over after `takeover_after_s` (5 s) of silence, at the peer's next beat."""
BACK_S = 8.0
"""From the heal, by when the cut listener runs tasks again."""
StartListener = Callable[..., Running]


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[NetNamespace]:
    """A network namespace joined to this one, removed at teardown."""
    ns = NetNamespace(tmp_path / "netns").start()
    yield ns
    ns.stop()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _start_pair(
    netns: NetNamespace,
    redis_url: str,
    db_url: str,
    tmp_path: Path,
    spawn: Spawned,
    start_listener: StartListener,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Client, Path, Path, str]:
    """The namespaced listener (its runs in one file) and its peer here (its runs in another);
    returns a client, both files and the namespaced one's /readyz URL."""
    settings = make_settings(redis_url, db_url, tmp_path)
    cut_runs, peer_runs = tmp_path / "cut-runs.txt", tmp_path / "peer-runs.txt"
    port = free_port()
    spawn.listen(
        settings,
        wrap=netns.command,
        KEYEXPIRY_HTTP=f"{netns.address}:{port}",
        **{sample_tasks.RUNS_FILE_ENV: str(cut_runs)},
    )
    monkeypatch.setenv(sample_tasks.RUNS_FILE_ENV, str(peer_runs))
    peer: Running = start_listener(settings)
    readyz = f"http://{netns.address}:{port}/readyz"
    wait_until(lambda: _ready(readyz), 20, message="the namespaced listener never got ready")
    wait_until(
        lambda: peer.listener.fleet.partition.peers == 1,
        10,
        message="the two listeners never shared the keys",
    )
    return Client(settings), cut_runs, peer_runs, readyz


@pytest.mark.parametrize(
    ("side", "cut_s", "server_db_url"),
    [
        pytest.param("redis", 8.0, "mysql", id="redis-mariadb"),
        # Long enough for TCP's retransmission backoff to leave a gap of 25 s after the heal
        # on a connection the partition caught (tries 13 s and 25 s after the first, then 51 s).
        # PostgreSQL's connections get the same limit from libpq (tests/test_store.py checks
        # the sockets of both).
        pytest.param("ledger", 27.0, "mysql", id="ledger-mariadb"),
    ],
    indirect=["server_db_url"],
)
def test_a_listener_partitioned_from_one_side_loses_nothing_and_comes_back(
    side: str,
    cut_s: float,
    redis_factory: RedisFactory,
    server_db_url: str,
    netns: NetNamespace,
    tmp_path: Path,
    spawn: Spawned,
    start_listener: StartListener,
    verdict: Verdict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every packet between the namespaced listener and Redis (or the ledger) dropped for
    `cut_s` while tasks fall due: its peer runs them (the share of a listener that hears no PING
    answer or cannot beat is taken over); a run the cut listener had started may run again only
    as a second attempt (GUARANTEES window 1); once the network heals it runs its share of new
    tasks within `BACK_S` (a connection the partition caught is given up after `UNACKED_S`
    unacknowledged; before, it waited for TCP's next retransmission: 24 s after a 27 s cut)."""
    server = redis_factory()
    c, cut_runs, peer_runs, readyz = _start_pair(
        netns, server.url(), server_db_url, tmp_path, spawn, start_listener, monkeypatch
    )
    with c:
        # Some tasks already due when the cut begins, so the cut listener holds runs then.
        early = c.create_many(
            TaskRequest("Probe.logged", (f"early{i}",), ttl_ms=100 + 10 * i) for i in range(40)
        )
        wait_until(lambda: len(sample_tasks.runs_in(cut_runs)) > 0, 10)
        ledger_port = sa.engine.make_url(server_db_url).port
        assert ledger_port is not None
        netns.cut({server.port} if side == "redis" else {ledger_port})
        cut_ms = c.clock.now_ms()
        try:
            keys = c.create_many(
                TaskRequest("Probe.logged", (f"during{i}",), ttl_ms=300 + 100 * i)
                for i in range(40)
            )
            # The peer runs all of them before the network heals.
            wait_until(
                lambda: all(k in RunsFile(peer_runs, cut_runs) for k in keys),
                max(0.1, SHARE_TAKEN_S - (c.clock.now_ms() - cut_ms) / 1000),
                message="the cut listener's share waited for the partition to end",
            )
            # The fault's own length, not a wait for something.
            time.sleep(max(0.0, cut_s - (c.clock.now_ms() - cut_ms) / 1000))
        finally:
            netns.heal()
        healed = time.monotonic()
        verdict.check(
            c,
            early + keys,
            fault_at_ms=cut_ms,
            at_least_once=side == "ledger",
            calls=RunsFile(peer_runs, cut_runs),
        )
        merged = RunsFile(peer_runs, cut_runs)
        rows = c.store.get_many(early + keys)
        twice = [k for k in early + keys if merged.get(k, 0) > 1]
        # A second run is a takeover's second attempt, never a second claim of one attempt.
        assert all(rows[k].attempts == merged[k] for k in twice), [rows[k] for k in twice[:3]]
        # Back to work: new tasks, a batch every half second, until it runs one of them (its
        # connections resume at TCP's next retransmission, seconds after the heal).
        before = len(sample_tasks.runs_in(cut_runs))
        later: list[str] = []

        def ran_again() -> bool:
            n = len(later)
            later.extend(
                c.create_many(
                    TaskRequest("Probe.logged", (f"after{n + i}",), ttl_ms=100 + 20 * i)
                    for i in range(10)
                )
            )
            return len(sample_tasks.runs_in(cut_runs)) > before

        wait_until(ran_again, 30, interval_s=0.5, message="the cut listener never ran again")
        back_s = time.monotonic() - healed
        assert back_s <= BACK_S, f"the cut listener ran again only {back_s:.1f} s after the heal"
        # /readyz asks the ledger at most once a second.
        wait_until(lambda: _ready(readyz), 10, message="the cut listener never got ready again")
        verdict.check(c, later, calls=RunsFile(peer_runs, cut_runs))


def test_a_listener_on_a_slow_lossy_network_runs_every_task_once(
    redis_factory: RedisFactory,
    mysql_url: str,
    netns: NetNamespace,
    tmp_path: Path,
    spawn: Spawned,
    verdict: Verdict,
) -> None:
    """The namespaced listener alone, its packets delayed 200 ms ± 100 ms and 5 % dropped
    (`tc netem delay 200ms 100ms loss 5%`): every task runs once, none early, each within 5 s
    of its due time (a claim and an outcome are a few round trips of 0.1-0.3 s each, and a lost
    packet costs a retransmission)."""
    server = redis_factory()
    settings = make_settings(server.url(), mysql_url, tmp_path)
    runs = tmp_path / "runs.txt"
    spawn.listen(settings, wrap=netns.command, **{sample_tasks.RUNS_FILE_ENV: str(runs)})
    with Client(settings) as c:
        netns.degrade(delay_ms=200, jitter_ms=100, loss=0.05)
        try:
            keys = c.create_many(
                TaskRequest("Probe.logged", (f"slow{i}",), ttl_ms=500 + 100 * i) for i in range(50)
            )
            row = verdict.check(c, keys, calls=RunsFile(runs), timeout_s=30)
        finally:
            netns.heal()
        rows = c.store.get_many(keys).values()
        late_ms = sorted(r.started_at_ms - r.due_at_ms for r in rows if r.started_at_ms)
        assert late_ms[-1] <= 5000, f"late up to {late_ms[-1]} ms (median {late_ms[25]})"
        # The network was slow for real: a run's claim and outcome took round trips of it.
        assert late_ms[len(late_ms) // 2] >= 100, late_ms
        assert row.run_twice == 0


def test_the_namespace_reaches_loopback_servers_and_a_cut_stops_only_its_packets(
    redis_factory: RedisFactory, netns: NetNamespace
) -> None:
    """The harness itself: from inside, a loopback server answers; cut, it does not (while it
    still answers here); healed, it answers again."""
    import subprocess
    import sys

    server = redis_factory()
    probe = [
        sys.executable,
        "-c",
        (
            "import socket,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{server.port}),timeout=2)\n"
            "s.sendall(b'PING\\r\\n');sys.exit(0 if s.recv(7)==b'+PONG\\r\\n' else 1)"
        ),
    ]

    def answers() -> bool:
        return subprocess.run(netns.command(probe), capture_output=True, timeout=10).returncode == 0

    assert answers()
    netns.cut({server.port})
    started = time.monotonic()
    assert not answers()
    assert time.monotonic() - started >= 1.5  # dropped, not refused: the connect timed out
    assert server.client().ping()
    netns.heal()
    assert answers()

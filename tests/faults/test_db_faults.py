"""The ledger misbehaving under a listener: ambiguous commits, row locks, skewed clocks, kill -9.

Every scenario runs on both database servers, MariaDB and PostgreSQL (`server_db_url`, or
`engine` where the test starts a server of its own); its row in docs/RELIABILITY.md names the
ledger it ran on. The commits are broken by the proxy for that server's wire protocol
(`MySQLProxy`, `PGProxy`).
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from loguru import logger
from sqlalchemy.engine import make_url

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import lock_waits, wait_until
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks
from tests.faults.spawn import ROOT, Spawned, keyexpiry_command, signal_group, subprocess_env
from tests.ke import Running, make_settings, wait_status
from tests.pg_proxy import PGProxy
from tests.proxy import Fault, MySQLProxy, WireProxy, updates_status
from tests.reliability import Verdict

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]

ENGINES = ("mariadb", "postgres")
"""The ledgers every scenario runs on (the ids of `server_db_url`'s parameters)."""


def engine_of(url: str) -> str:
    """`mariadb` or `postgres`: the server a SQLAlchemy URL names."""
    return "postgres" if make_url(url).get_backend_name() == "postgresql" else "mariadb"


@pytest.fixture
def ledger(redis_url: str, server_db_url: str, tmp_path: Path) -> Iterator[Client]:
    """A client on the session Redis and a fresh MariaDB or PostgreSQL database."""
    sample_tasks.reset()
    with Client(make_settings(redis_url, server_db_url, tmp_path)) as client:
        yield client
    sample_tasks.reset()


@pytest.fixture
def proxy(server_db_url: str) -> Iterator[WireProxy]:
    """A proxy in front of `server_db_url`'s server, for its protocol; give listeners
    `proxy.url`."""
    kind = PGProxy if engine_of(server_db_url) == "postgres" else MySQLProxy
    with kind(server_db_url) as p:
        yield p


@pytest.mark.parametrize(
    ("status", "fault", "times"),
    [
        pytest.param("running", "reply", 1, id="claim-reply lost"),
        pytest.param("running", "reply", 2, id="claim-reply lost twice"),
        pytest.param("running", "commit", 1, id="claim-commit lost"),
        pytest.param("done", "reply", 1, id="record-reply lost"),
        pytest.param("done", "reply", 2, id="record-reply lost twice"),
        pytest.param("done", "commit", 1, id="record-commit lost"),
        pytest.param("done", "commit", 2, id="record-commit lost twice"),
    ],
)
def test_ambiguous_commit(
    ledger: Client,
    proxy: WireProxy,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    status: str,
    fault: Fault,
    times: int,
) -> None:
    # The claim (status='running') or the record (status='done') loses its connection at its
    # commit: "reply" after the server committed, "commit" before it could. Both are
    # autocommitted (the UPDATE is its own commit; on PostgreSQL committed at its Sync, the
    # claim's UPDATE … RETURNING inside a SELECT), so the statement is what breaks.
    proxy.break_statement(updates_status(status), fault=fault, times=times)
    cfg = make_settings(redis_url, proxy.url, tmp_path, handler_timeout_s=1.0, lease_grace_s=0.5)
    running = start_listener(cfg)
    keys = ledger.create_many(
        TaskRequest("Probe.record", (f"amb{i}",), ttl_ms=200 + 10 * i) for i in range(10)
    )
    wait_until(lambda: proxy.broken == times, 15, message="the COMMIT was never broken")
    verdict.check(ledger, keys, timeout_s=20)
    attempts = sorted(r.attempts for r in ledger.store.get_many(keys).values())
    # Recovered at once, not by the lease: a claim retried under its token finds the rows its
    # lost commit took (also when the store's own retry lost its answer too: the claimer claims
    # again under the same token); a record retried finds them done and runs nothing again.
    assert attempts == [1] * len(keys), attempts
    running.stop()


@pytest.mark.parametrize(
    ("timeout_s", "grace_s"),
    [
        pytest.param(30.0, 5.0, id="lease outlasts the outage"),
        pytest.param(0.5, 0.5, id="outage outlasts the lease"),
    ],
)
def test_a_claim_lost_in_a_failover_runs_once_the_ledger_answers(
    ledger: Client,
    proxy: WireProxy,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    timeout_s: float,
    grace_s: float,
) -> None:
    # The claim commits and its answer is lost; then the database is out of reach for 2 s
    # (every connection cut, new ones refused), so the store's one retry fails as well.
    # With a long lease (35 s) only settling the claim under its token runs these tasks in
    # time; with one shorter than the outage (1 s) the settled runs must first extend the lease
    # their lost claim set, under the token, or find the rows taken over: once either way.
    cfg = make_settings(
        redis_url, proxy.url, tmp_path, handler_timeout_s=timeout_s, lease_grace_s=grace_s
    )
    running, keys, late_ms = _through_an_outage(ledger, proxy, start_listener, verdict, cfg, 2.0)
    assert late_ms < 3000, f"the last task finished {late_ms} ms after the ledger answered"
    rows = ledger.store.get_many(keys).values()
    if timeout_s > 2.0:
        assert [r.attempts for r in rows] == [1] * len(keys)
    assert running.listener.dispatcher.stats.claims_settled >= 1
    running.stop()


def _extends_a_lease(statements: Sequence[bytes]) -> bool:
    """A rule matching the lease extension of a late-starting run: an UPDATE that sets the lease
    and not the status (a claim sets both)."""
    return any(
        s.startswith(b"UPDATE time_limit_task SET")
        and b"lease_until_ms=" in s
        and b"status=" not in s
        for s in statements
    )


def test_a_late_run_whose_lease_extension_meets_an_outage_runs_once_the_ledger_answers(
    ledger: Client,
    proxy: WireProxy,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
) -> None:
    # A run that waited in the queue past half its lease's grace asks the ledger to extend its
    # lease before it starts. Met by a failover (the statement lost, then 2 s without a
    # ledger), it was given up at once and its task waited its whole lease, then ran on a
    # second attempt: a hundred tasks of a wave in the PostgreSQL failover test on a loaded CI
    # machine. It must wait for the ledger while its lease lasts (5.5 s here) and run then.
    cfg = make_settings(
        redis_url, proxy.url, tmp_path, concurrency=1, handler_timeout_s=5.0, lease_grace_s=0.5
    )
    running = start_listener(cfg)
    blocker = ledger.create("Probe.wait", "outage", ttl_ms=0)
    wait_until(lambda: sample_tasks.CALLS[blocker] == 1, 5)
    queued = ledger.create("Probe.record", "outage", ttl_ms=0)
    claimed = wait_status(ledger, queued, TaskStatus.RUNNING)
    assert claimed.started_at_ms is not None and sample_tasks.CALLS[queued] == 0
    # Past half the grace: the lease left no longer covers a whole run.
    wait_until(lambda: ledger.clock.now_ms() > claimed.started_at_ms + 400, 5)  # type: ignore[operator]
    proxy.break_commit(_extends_a_lease, fault="commit", failover_s=2.0)
    sample_tasks.gate("outage").set()
    wait_until(lambda: proxy.broken == 1, 10, message="the extension never reached the proxy")
    row = wait_status(ledger, queued, TaskStatus.DONE, timeout_s=15)
    stats = running.listener.dispatcher.stats
    assert (row.attempts, sample_tasks.CALLS[queued]) == (1, 1), "given up to its lease"
    assert (stats.lease_waits, stats.leases_extended, stats.claims_lost) == (1, 1, 0)
    running.stop()


def test_a_long_outage_ends_the_claimers_backoff_when_the_ledger_answers(
    ledger: Client,
    proxy: WireProxy,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # Production backoff (0.5 s doubling to 30 s) and an 8 s outage: the claimer's waits grew
    # to 8 s, and the tasks it held ran up to 8 s after the ledger answered again (up to 30 s
    # in a longer one; 16 s in the Patroni soak's failover). A new connection that another
    # thread (the heartbeat) opens once the ledger answers ends the wait.
    cfg = make_settings(
        redis_url, proxy.url, tmp_path, reconnect_initial_s=0.5, reconnect_max_s=30.0
    )
    running, _, late_ms = _through_an_outage(ledger, proxy, start_listener, verdict, cfg, 8.0)
    assert late_ms < 3000, f"the last task finished {late_ms} ms after the ledger answered"
    running.stop()


_REFUSE_UPDATES = {
    "postgres": [
        "CREATE FUNCTION ke_refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
        "CREATE TRIGGER ke_refuse BEFORE UPDATE ON time_limit_task FOR EACH ROW "
        "EXECUTE FUNCTION ke_refuse()",
    ],
    "mariadb": [
        "CREATE TRIGGER ke_refuse BEFORE UPDATE ON time_limit_task FOR EACH ROW "
        "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'",
    ],
}


def test_claims_refused_while_heartbeats_get_through_are_retried_at_the_next_beat(
    ledger: Client,
    redis_url: str,
    server_db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # Production backoff (0.5 s doubling to 30 s). The ledger refuses every change to a task
    # row (a trigger here; a standby behind a proxy, a switchover's last moments in the Patroni
    # soak) but takes the heartbeats, on connections it already had: no new connection ends
    # the claimer's wait, which was 8 s after the fifth failure. Each heartbeat now ends it.
    from sqlalchemy import text

    cfg = make_settings(
        redis_url, server_db_url, tmp_path, reconnect_initial_s=0.5, reconnect_max_s=30.0
    )
    running = start_listener(cfg)
    stats = running.listener.dispatcher.stats
    engine = ledger.store.engine
    with engine.begin() as conn:
        for sql in _REFUSE_UPDATES[engine_of(server_db_url)]:
            conn.execute(text(sql))
    errors = stats.store_errors
    key = ledger.create("Probe.record", "refused", ttl_ms=200)
    # Retried at the heartbeats' pace (every 0.5-1 s): six tries within 12 s. The backoff alone
    # tries at 0, 0.5, 1.5, 3.5 and 7.5 s, then 15.5 s.
    wait_until(
        lambda: stats.store_errors >= errors + 6,
        12,
        message="fewer than 6 claims tried in 12 s: the backoff was not cut short",
    )
    with engine.begin() as conn:
        conn.execute(
            text("DROP TRIGGER ke_refuse ON time_limit_task")
            if engine_of(server_db_url) == "postgres"
            else text("DROP TRIGGER ke_refuse")
        )
    allowed_ms = ledger.clock.now_ms()
    row = wait_status(ledger, key, TaskStatus.DONE, timeout_s=30)
    assert row.started_at_ms is not None
    assert row.started_at_ms - allowed_ms < 2000, (
        f"the claim was retried {row.started_at_ms - allowed_ms} ms after the ledger took it"
    )
    verdict.check(ledger, [key])
    running.stop()


def _through_an_outage(
    ledger: Client,
    proxy: WireProxy,
    start_listener: StartListener,
    verdict: Verdict,
    cfg: Settings,
    outage_s: float,
) -> tuple[Running, list[str], int]:
    """A listener on `cfg`, ten tasks due at once, a claim's answer lost and the database then
    out of reach for `outage_s`; once every task ran: the listener, the keys, and how long
    after the ledger answered again the last one finished (rows the lost commit took keep
    that commit's start time, so the finish is what counts)."""
    proxy.break_statement(updates_status("running"), fault="reply", failover_s=outage_s)
    running = start_listener(cfg)
    keys = ledger.create_many(
        TaskRequest("Probe.record", (f"fo{i}",), ttl_ms=300 + 10 * i) for i in range(10)
    )
    wait_until(
        lambda: proxy.answering_again_s is not None, outage_s + 13, message="no failover happened"
    )
    back_ms = ledger.clock.now_ms()
    verdict.check(ledger, keys, timeout_s=20 + outage_s, since_ms=back_ms)
    rows = ledger.store.get_many(keys).values()
    return running, keys, max((r.finished_at_ms or 0) for r in rows) - back_ms


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """The listener's log lines of level WARNING and up, while the test runs."""
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    yield lines
    logger.remove(handler)


@dataclass
class LockingServer:
    """A database server of its own whose lock wait timeout is 1 s (MariaDB's
    `innodb_lock_wait_timeout`, PostgreSQL's `lock_timeout`, which keyexpiry keeps in its
    sessions), with a database `locks`."""

    url: str
    """The `locks` database's SQLAlchemy URL."""
    timeout_text: str
    """What the server's error says when a lock wait times out."""
    _connect: Callable[..., Any]
    _count_waits: Callable[[Any], int]

    def locker(self) -> Any:
        """A DB-API connection to `locks` in a transaction of its own (rollback, close)."""
        return self._connect(autocommit=False)

    def watcher(self) -> Any:
        """An autocommitted DB-API connection, for `lock_waits`."""
        return self._connect(autocommit=True)

    def lock_waits(self, watcher: Any) -> int:
        """Sessions waiting for a row lock, seen from `watcher`."""
        return self._count_waits(watcher)


def _pg_lock_waits(conn: Any) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = 'locks' AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture
def locking_server(engine: str, request: pytest.FixtureRequest) -> LockingServer:
    """`LockingServer` on `engine`'s server (its factory's: killed when the test ends)."""
    if engine == "postgres":
        pg = request.getfixturevalue("postgres_factory")(args=["-c", "lock_timeout=1s"])
        return LockingServer(
            pg.create_database("locks"),
            "canceling statement due to lock timeout",
            lambda **kw: pg.admin_connection(dbname="locks", **kw),
            _pg_lock_waits,
        )
    maria = request.getfixturevalue("mariadb_factory")(args=["--innodb-lock-wait-timeout=1"])
    return LockingServer(
        maria.create_database("locks"),
        "Lock wait timeout",
        lambda **kw: maria.admin_connection(database="locks", **kw),
        lock_waits,
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_row_locked_past_the_lock_wait_timeout(
    locking_server: LockingServer,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    warnings_logged: list[str],
    verdict: Verdict,
) -> None:
    server = locking_server
    cfg = make_settings(redis_url, server.url, tmp_path)
    sample_tasks.reset()
    with Client(cfg) as c:
        start_listener(cfg)
        # All due at the same millisecond: they expire together and are claimed in a batch.
        keys = c.create_many(
            TaskRequest("Probe.record", (f"lock{i}",), ttl_ms=800) for i in range(6)
        )
        locked, others = keys[0], keys[1:]
        # Another session (an operator, a report, business code) holds the row past the
        # server's 1 s lock wait timeout, through more than one claim of it.
        locker = server.locker()
        try:
            with locker.cursor() as cur:
                cur.execute(
                    "SELECT id FROM time_limit_task WHERE task_key = %s FOR UPDATE", (locked,)
                )
            wait_until(
                lambda: all(r.status is TaskStatus.DONE for r in c.store.get_many(others).values()),
                15,
                message="the rest of the batch waited for the locked row",
            )
            text = server.timeout_text
            assert any(text in line for line in warnings_logged), warnings_logged
            # The overdue check offers the locked task again, and again it is left pending.
            wait_until(
                lambda: sum("row locked by another" in line for line in warnings_logged) >= 2,
                10,
                message=f"the locked task was not tried again: {warnings_logged}",
            )
            row = c.store.get(locked)
            assert row is not None and row.status is TaskStatus.PENDING
            assert sample_tasks.CALLS[locked] == 0
        finally:
            locker.rollback()
            locker.close()
        verdict.check(c, keys, since_ms=c.clock.now_ms())


@pytest.mark.parametrize("engine", ENGINES)
def test_outcomes_are_recorded_around_a_row_locked_past_the_lock_wait_timeout(
    locking_server: LockingServer,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """Scenario 16 at the other end of a run: the row is locked after the claim, while its
    handler runs. Its outcome waits for the lock; the outcomes behind it must not (retried as
    one batch they would wait as long as the lock is held, long enough for their leases to run
    out and their tasks to run twice)."""
    server = locking_server
    cfg = make_settings(redis_url, server.url, tmp_path)
    sample_tasks.reset()
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(TaskRequest("Probe.wait", (f"rec{i}",), ttl_ms=0) for i in range(6))
        wait_until(lambda: all(sample_tasks.CALLS[k] == 1 for k in keys), 10)
        locked, others = keys[0], keys[1:]
        locker = server.locker()
        watcher = server.watcher()
        try:
            with locker.cursor() as cur:
                cur.execute(
                    "SELECT id FROM time_limit_task WHERE task_key = %s FOR UPDATE", (locked,)
                )
            sample_tasks.gate("rec0").set()
            # The recorder is waiting on the lock with the locked outcome: the rest finish now.
            wait_until(lambda: server.lock_waits(watcher) == 1, 10, interval_s=0.2)
            for i in range(1, len(keys)):
                sample_tasks.gate(f"rec{i}").set()
            wait_until(
                lambda: all(r.status is TaskStatus.DONE for r in c.store.get_many(others).values()),
                10,
                message="the outcomes behind the locked row waited for it",
            )
            row = c.store.get(locked)
            assert row is not None and row.status is TaskStatus.RUNNING
        finally:
            locker.rollback()
            locker.close()
            watcher.close()
        verdict.check(c, keys, since_ms=c.clock.now_ms())


@pytest.mark.parametrize("skew", ["+10m", "-10m"])
def test_application_clock_skewed(
    ledger: Client,
    redis_url: str,
    server_db_url: str,
    tmp_path: Path,
    spawn: Spawned,
    verdict: Verdict,
    skew: str,
) -> None:
    # The listener and one `create` run with their wall clock `skew` away from Redis's and the
    # database's; keyexpiry's clock is Redis TIME, so nothing may change.
    cfg = make_settings(redis_url, server_db_url, tmp_path)
    _, log = spawn.listen(cfg, skew=skew)
    assert wall_clock_offset_ms(log, ledger) > 9 * 60 * 1000, "faketime did not skew it"
    keys: list[str] = list(
        ledger.create_many(
            TaskRequest("Probe.record", (f"skew{i}",), ttl_ms=300 + 100 * i) for i in range(5)
        )
    )
    before_ms = ledger.clock.now_ms()
    out = subprocess.run(
        keyexpiry_command("create", "Probe", "record", "cli", "--ttl-ms", "800", skew=skew),
        cwd=ROOT,
        env=subprocess_env(cfg),
        capture_output=True,
        check=True,
        timeout=60,
    )
    after_ms = ledger.clock.now_ms()
    cli_key = out.stdout.decode().strip()
    row = ledger.store.get(cli_key)
    assert row is not None and before_ms + 800 <= row.due_at_ms <= after_ms + 800, row
    keys.append(cli_key)
    wait_until(
        lambda: all(r.status is TaskStatus.DONE for r in ledger.store.get_many(keys).values()),
        15,
        message=f"the skewed listener did not run them; its log:\n{log.read_text()[-3000:]}",
    )
    rows = ledger.store.get_many(keys)
    now_ms = ledger.clock.now_ms()
    for r in rows.values():
        assert r.started_at_ms is not None and r.finished_at_ms is not None
        # Started on time and finished by now, by Redis's clock: the listener's clock is not
        # off by anything like the skew (a few ms of sync error on a loaded machine are fine).
        assert 0 <= r.started_at_ms - r.due_at_ms < 2000, r
        assert r.finished_at_ms < now_ms + 1000, r
    verdict.check(ledger, keys, calls={k: r.attempts for k, r in rows.items()})


def wall_clock_offset_ms(log: Path, ledger: Client) -> int:
    """How far the wall clock stamping the log's first line is from Redis's clock, in ms."""
    stamp = log.read_text().splitlines()[0].split(" ", 1)[0]
    local = dt.datetime.fromisoformat(stamp)
    return abs(int(local.timestamp() * 1000) - ledger.clock.now_ms())


def test_listener_killed_between_claim_and_handler_start(
    ledger: Client,
    proxy: WireProxy,
    redis_url: str,
    server_db_url: str,
    tmp_path: Path,
    spawn: Spawned,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    waiting = ledger.key_for("Probe.record", "claimed")
    # The first listener's claim of `waiting` commits (its UPDATE, autocommitted), and its
    # answer never arrives: the row is running under that listener while no handler of it has
    # started (or can: `claim` has not returned).
    proxy.break_statement(updates_status("running", mentioning=waiting), fault="hold")
    first = make_settings(redis_url, proxy.url, tmp_path)
    proc, log = spawn.listen(first, KEYEXPIRY_CONCURRENCY="1", KEYEXPIRY_HANDLER_TIMEOUT_S="2")
    # Its only worker is taken by a handler that hangs (past its 0.3 s timeout, so the slot is
    # given back while the thread still hangs); `waiting` is due meanwhile and is claimed next.
    hung = ledger.create("Probe.hang_first", "hung", ttl_ms=100)
    wait_status(ledger, hung, TaskStatus.RUNNING, timeout_s=20)
    assert ledger.create("Probe.record", "claimed", ttl_ms=100) == waiting
    wait_until(lambda: proxy.broken == 1, 20, message=f"never claimed:\n{log.read_text()}")
    wait_status(ledger, waiting, TaskStatus.RUNNING, timeout_s=5)
    signal_group(proc, signal.SIGKILL)
    proc.wait(10)
    start_listener(make_settings(redis_url, server_db_url, tmp_path))
    base = verdict.scenario
    # Claimed but never started: run by the second listener only, once, after the lease.
    verdict.scenario = f"{base} [claimed, not started]"
    # The first listener never ran it, so this process's handler count is the whole count.
    verdict.check(ledger, [waiting])
    row = ledger.store.get(waiting)
    assert row is not None and row.attempts == 2 and sample_tasks.CALLS[waiting] == 1
    # The hung handler had started: the crash window of docs/GUARANTEES.md, at least once.
    verdict.scenario = f"{base} [handler hung]"
    done = wait_status(ledger, hung, TaskStatus.DONE, timeout_s=20)
    verdict.check(ledger, [hung], at_least_once=True, calls={hung: done.attempts})

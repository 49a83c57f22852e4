"""The ledger on a PostgreSQL primary and its streaming standby, the primary killed -9 mid-wave.

A primary and a hot standby cloned from it (`pg_basebackup`); the ledger URL names both hosts
with `target_session_attrs=read-write` (libpq's multi-host failover, through SQLAlchemy's
repeated `host=`) and `connect_timeout=2`, so a new connection goes to whichever of them takes
writes. Two listeners, 3,000 tasks due over 6 s and a producer creating a task every 10 ms; once
40 % of the wave has run the primary is killed -9, and 1 s later the standby is promoted (an
operator or Patroni takes seconds; until then no host qualifies and every connect fails at
once). Every task must run, none be left `running`, none pending without its key; every create
that returned has its row, and a create that failed raised `StoreError` (a refused create with a
row runs once, one without never runs).

Two replication modes (`replication`):

- `sync`: the primary runs `synchronous_standby_names='*'` and `synchronous_commit=remote_apply`,
  what a team that cannot lose a commit runs: a commit is answered only once the standby has
  applied it, so whatever keyexpiry was told had committed is on the promoted standby. Asserted
  as for Galera: each task ran once and was claimed once (none waited for its lease).
- `async`: PostgreSQL's default, asynchronous streaming. A commit answered by the primary but not
  yet streamed when it died is missing on the promoted standby: a create that returned can vanish
  (its key expires on no row), a claim can vanish (the task runs, its outcome matches no row, the
  overdue check runs it again), an outcome can vanish (the row stays `running` under the old
  claim until its lease ends, then runs again: attempt 2). The test reads the standby's ledger
  after the kill and before the promotion, then the dead primary's (restarted alone once the
  listeners are stopped), and asserts that every task run twice, lost or held until its lease is
  a row whose change the standby never received, of the matching kind. Nothing else may go wrong.

`KEYEXPIRY_PG_FAILOVER_RUNS=5` runs each mode five times (a new pair of servers each time); the
suite runs each once.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import LOOPBACK, PostgresServer, wait_until
from keyexpiry.errors import KeyExpiryError, StoreError
from keyexpiry.ledger.store import TaskRow, TaskStatus
from tests import sample_tasks
from tests.conftest import PostgresFactory
from tests.ke import Running, make_settings
from tests.reliability import Verdict

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]

RUNS = int(os.environ.get("KEYEXPIRY_PG_FAILOVER_RUNS") or "1")
TASKS = 3000
FIRST_DUE_MS = 2000
"""From the create to the first due time: 3,000 rows written (and applied on the standby in sync
mode) first."""
SPREAD_MS = 6000
KILL_AT_SHARE = 0.4
"""The primary is killed once this share of the wave has run."""
PROMOTE_AFTER_S = 1.0
PRODUCER_TTL_MS = 500
PRODUCER_EVERY_S = 0.01
AFTER_PROMOTION = 50
"""Creates the producer makes once the standby is promoted, before it stops."""
SETTLE_S = 45.0
"""Time for every task to end: a lease (12 s) and more, for async mode's lost outcomes."""
# Short handler timeouts, yet a lease (12 s) longer than the failover: a claim lost in it and
# left to its lease shows as a second attempt, and late (as in the Galera test).
TIMINGS: dict[str, Any] = {"handler_timeout_s": 10.0, "lease_grace_s": 2.0}

Snapshot = dict[str, tuple[Any, ...]]
"""A ledger's rows by key: (status, claimed_by, attempts, due_at_ms)."""
STATE = "SELECT task_key, status, claimed_by, attempts, due_at_ms FROM time_limit_task"
EXPLAINED_BY = {"lost": {"create"}, "twice": {"claim", "outcome"}, "held": {"outcome"}}
"""In async mode, which lost change of its row explains each anomaly of a task."""


@dataclass
class Pair:
    """A primary, its streaming standby, and the ledger URL naming both."""

    primary: PostgresServer
    standby: PostgresServer
    db: str
    url: str


def _scalar(server: PostgresServer, sql: str, db: str = "postgres") -> Any:
    with server.admin_connection(dbname=db) as conn:
        row = conn.execute(sql).fetchone()
    return None if row is None else row[0]


def _snapshot(server: PostgresServer, db: str) -> Snapshot:
    with server.admin_connection(dbname=db) as conn:
        return {str(r[0]): tuple(r[1:]) for r in conn.execute(STATE).fetchall()}


@pytest.fixture
def pair(postgres_factory: PostgresFactory, replication: str) -> Pair:
    """A primary with a database, its standby streaming (a row written on the primary is
    visible there), synchronous in `sync` mode; the ledger URL naming both."""
    primary = postgres_factory()
    db = f"pg_{secrets.token_hex(4)}"
    primary.create_database(db)
    with primary.admin_connection() as conn:
        conn.execute("CREATE TABLE streamed (id INT PRIMARY KEY)")
    standby = postgres_factory(primary=primary)
    with primary.admin_connection() as conn:
        conn.execute("INSERT INTO streamed VALUES (1)")
    wait_until(
        lambda: _scalar(standby, "SELECT count(*) FROM streamed") == 1,
        30,
        interval_s=0.05,
        message="the standby is not streaming",
    )
    if replication == "sync":
        # On the primary only, after the base backup: the promoted standby must not wait for a
        # standby of its own (it has none), or every commit after the failover would hang.
        with primary.admin_connection() as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'remote_apply'")
            conn.execute("SELECT pg_reload_conf()")
        synchronous = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
        wait_until(
            lambda: _scalar(primary, synchronous) == 1,
            10,
            interval_s=0.05,
            message="the standby never became synchronous",
        )
    hosts = f"host={LOOPBACK}:{primary.port}&host={LOOPBACK}:{standby.port}"
    url = (
        f"postgresql+psycopg://postgres@/{db}?{hosts}"
        "&target_session_attrs=read-write&connect_timeout=2"
    )
    return Pair(primary, standby, db, url)


@dataclass
class Producer:
    """Creates a task every 10 ms on a thread; remembers which creates returned and which
    raised StoreError, and what it said."""

    client: Client
    created: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    other: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            key = self.client.key_for("Probe.record", f"p{i}")
            try:
                self.client.create("Probe.record", f"p{i}", ttl_ms=PRODUCER_TTL_MS)
                self.created.append(key)
            except StoreError as exc:
                self.refused[key] = str(exc)
            except KeyExpiryError as exc:
                self.other.append(exc)
            self._stop.wait(PRODUCER_EVERY_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@dataclass
class Loss:
    """What one run saw: the times, the ledgers before and after, the producer's creates."""

    ran_before_kill: int = 0
    created_before_kill: int = 0
    killed_ms: int = 0
    promoted_ms: int = 0
    promoted_s: float = 0.0
    standby_at_loss: Snapshot = field(default_factory=dict)
    primary_at_loss: Snapshot = field(default_factory=dict)


def _ran(keys: Iterable[str]) -> int:
    return sum(1 for k in keys if sample_tasks.CALLS.get(k, 0))


def _settled(client: Client, keys: Iterable[str]) -> bool:
    """Every row of `keys` done. A key without a row has none for good (a create that returned
    committed it, or lost it with the primary; one that raised left it or not): not waited for."""
    return all(r.status is TaskStatus.DONE for r in client.store.get_many(list(keys)).values())


def _kill_and_promote(
    pair: Pair, client: Client, wave: Sequence[str], producer: Producer, loss: Loss
) -> None:
    """Kill the primary once `KILL_AT_SHARE` of the wave ran; read what the standby has; promote
    it `PROMOTE_AFTER_S` after the kill."""
    wait_until(lambda: _ran(wave) >= KILL_AT_SHARE * TASKS, 30, interval_s=0.005)
    loss.ran_before_kill = _ran(wave)
    loss.created_before_kill = len(producer.created)
    pair.primary.kill()
    loss.killed_ms, killed_s = client.clock.now_ms(), time.monotonic()
    # What the standby holds at the loss: its WAL receiver gone (the primary is dead) and all it
    # received applied. Read before the promotion, while nothing can write to it.
    caught_up = (
        "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_wal_receiver)"
        " AND pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()"
    )
    wait_until(lambda: _scalar(pair.standby, caught_up), 10, interval_s=0.01)
    loss.standby_at_loss = _snapshot(pair.standby, pair.db)
    time.sleep(max(0.0, PROMOTE_AFTER_S - (time.monotonic() - killed_s)))
    pair.standby.promote()
    loss.promoted_ms, loss.promoted_s = client.clock.now_ms(), time.monotonic()


def _missed(standby: Snapshot, primary: Snapshot) -> dict[str, str]:
    """The rows whose last change on the dead primary the standby never got, by key, with what
    the change was: `create`, `claim` (pending there, running or done here) or `outcome`
    (running there, done here)."""
    found: dict[str, str] = {}
    for key in standby.keys() | primary.keys():
        had, got = primary.get(key), standby.get(key)
        if had == got:
            continue
        if got is None:
            found[key] = "create"
        elif had is None:
            found[key] = "only on the standby"
        elif got[0] == "pending" and had[0] in ("running", "done"):
            found[key] = "claim"
        elif got[0] == "running" and had[0] == "done":
            found[key] = "outcome"
        else:
            found[key] = f"{got[0]} instead of {had[0]}"
    return found


def _p(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0


def _summary(rows: dict[str, TaskRow], keys: list[str]) -> dict[str, int]:
    calls = [sample_tasks.CALLS.get(k, 0) for k in keys]
    late = [r.started_at_ms - r.due_at_ms for r in rows.values() if r.started_at_ms is not None]
    return {
        "tasks": len(keys),
        "once": sum(1 for n in calls if n == 1),
        "twice": sum(1 for n in calls if n > 1),
        "not_run": sum(1 for n in calls if n == 0),
        "not_done": sum(1 for k in keys if k not in rows or rows[k].status is not TaskStatus.DONE),
        "held_until_lease": sum(1 for r in rows.values() if r.attempts > 1),
        "late_p50_ms": _p(late, 0.50),
        "late_p99_ms": _p(late, 0.99),
        "late_max_ms": max(late, default=0),
    }


def _anomalies(
    client: Client,
    rows: dict[str, TaskRow],
    final: Snapshot,
    created: list[str],
    refused: dict[str, str],
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(what only a lost commit may explain, what nothing explains), each a list of keys.
    `final` is the whole table on the new primary."""
    refused_rows = [k for k in refused if k in rows]
    explainable = {
        # A create that returned, with no row, or never run.
        "lost": [k for k in created if k not in rows or not sample_tasks.CALLS.get(k, 0)],
        "twice": [k for k in [*created, *refused_rows] if sample_tasks.CALLS.get(k, 0) > 1],
        # Claimed more than once: held by a claim nobody ran until its lease ran out.
        "held": [k for k, r in rows.items() if r.attempts > 1],
    }
    never = {
        "left_running": [k for k, (status, *_) in final.items() if status == "running"],
        "pending_without_key": [
            k
            for k, (status, *_) in final.items()
            if status == "pending" and not client.redis.exists(k)
        ],
        # A create that raised and left no row must not run.
        "refused_ran_without_row": [
            k for k in refused if k not in rows and sample_tasks.CALLS.get(k, 0)
        ],
    }
    return explainable, never


@pytest.mark.parametrize("run", [pytest.param(i, id=f"run{i}") for i in range(1, RUNS + 1)])
@pytest.mark.parametrize("replication", ["sync", "async"])
def test_a_postgres_primary_lost_mid_wave_loses_nothing(
    run: int,
    replication: str,
    pair: Pair,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    log_lines: list[str],
    verdict: Verdict,
) -> None:
    verdict.backend = "postgres"
    started_s = time.monotonic()
    sample_tasks.reset()
    loss = Loss()
    with Client(make_settings(redis_url, pair.url, tmp_path / "client", **TIMINGS)) as client:
        with client.store.engine.connect() as conn:
            mode = conn.exec_driver_sql("SHOW synchronous_commit").scalar()
        assert mode == ("remote_apply" if replication == "sync" else "on"), mode
        listeners = [
            start_listener(make_settings(redis_url, pair.url, tmp_path / name, **TIMINGS))
            for name in ("a", "b")
        ]
        wave = client.create_many(
            TaskRequest("Probe.record", (f"w{i}",), ttl_ms=FIRST_DUE_MS + i * SPREAD_MS // TASKS)
            for i in range(TASKS)
        )
        producer = Producer(client)
        try:
            wait_until(lambda: len(producer.created) >= 20, 10)
            _kill_and_promote(pair, client, wave, producer, loss)
            after = len(producer.created)
            wait_until(
                lambda: len(producer.created) >= after + AFTER_PROMOTION,
                30,
                message="no create succeeded after the promotion",
            )
        finally:
            producer.stop()
        created, refused = [*wave, *producer.created], dict(producer.refused)
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and not _settled(client, [*created, *refused]):
            time.sleep(0.05)
        settled_s = time.monotonic()
        rows = client.store.get_many([*created, *refused])
        final = _snapshot(pair.standby, pair.db)
        explainable, never = _anomalies(client, rows, final, created, refused)
        claims_settled = sum(r.listener.dispatcher.stats.claims_settled for r in listeners)
        # Nothing may reach the old primary once it is back (it would take writes: the URL names
        # it first): the listeners stop, the client waits, and it is killed again once read.
        for running in listeners:
            running.stop()
        pair.primary.start()
        try:
            loss.primary_at_loss = _snapshot(pair.primary, pair.db)
        finally:
            pair.primary.kill()
        missed = _missed(loss.standby_at_loss, loss.primary_at_loss)
        refused_rows = [k for k in refused if k in rows]
        answers = [line.rstrip() for line in log_lines if "ledger answers again" in line]
        outage_s = (loss.promoted_ms - loss.killed_ms) / 1000
        recovery_s, test_s = settled_s - loss.promoted_s, time.monotonic() - started_s
        print(
            f"\npostgres {replication} run {run}: {_summary(rows, [*created, *refused_rows])}",
            f"ran before the kill {loss.ran_before_kill} of {TASKS}; producer:"
            f" {len(created) - TASKS} created ({loss.created_before_kill} by the kill),"
            f" {len(refused)} refused ({len(refused_rows)} of them with a row)",
            f"kill to promotion {outage_s:.2f} s, promotion to all done {recovery_s:.2f} s,"
            f" test {test_s:.1f} s",
            f"changes the standby never got: {dict(Counter(missed.values()))}",
            f"anomalies: { {k: v for k, v in explainable.items() if v} }",
            f"claims settled after the loss: {claims_settled}",
            *answers[:4],
            *sorted(set(refused.values()))[:4],
            sep="\n  ",
        )

        assert not producer.other, producer.other[:3]
        assert refused, "no create met the loss: the scenario did not happen"
        for key, message in refused.items():  # the task, its state, the ledger, what failed
            assert message.startswith(f"task {key}: "), message
            assert "database postgresql+psycopg://" in message, message
            if key in rows:  # recorded after all: the error must not have said it was not
                assert "may have been recorded" in message, message
        assert not any(never.values()), never
        if replication == "sync":
            assert not any(explainable.values()), explainable
        else:
            unexplained = {
                what: [k for k in keys if missed.get(k) not in EXPLAINED_BY[what]]
                for what, keys in explainable.items()
            }
            kinds = {
                w: dict(Counter(str(missed.get(k)) for k in ks)) for w, ks in unexplained.items()
            }
            lost_runs = sum(r.listener.dispatcher.stats.claims_lost for r in listeners)
            assert not any(unexplained.values()), (
                f"not explained by a commit the standby never got: {unexplained}; what the"
                f" standby missed of them: {kinds}; runs given up by the listeners: {lost_runs}"
            )
        lost = set(explainable["lost"])
        if lost:  # counted nowhere else: say it in the row's name
            verdict.scenario += f" ({len(lost)} created, lost with the primary)"
        row = verdict.check(
            client,
            [k for k in created if k not in lost] + refused_rows,
            since_ms=loss.promoted_ms,
            timeout_s=5,
            at_least_once=replication == "async",
        )
        print(f"  reliability row: {row}")


@pytest.mark.parametrize("replication", ["async"])
def test_a_create_refused_while_no_host_takes_writes_says_whether_it_was_recorded(
    pair: Pair, redis_url: str, tmp_path: Path
) -> None:
    """With the primary dead and the standby not promoted yet, a create raises: its message must
    name the task and say whether it was recorded (here it was not: no server took writes)."""
    with Client(make_settings(redis_url, pair.url, tmp_path)) as client:
        key = client.key_for("Probe.record", "refused")
        pair.primary.kill()
        with pytest.raises(StoreError) as refused:
            client.create("Probe.record", "refused", ttl_s=60)
        pair.standby.promote()
        assert client.store.get(key) is None
        message = str(refused.value)
        assert message.startswith(f"task {key}: not recorded"), message

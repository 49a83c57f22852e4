"""The listener killed, the database down, races at the due instant."""

from __future__ import annotations

import datetime as dt
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import MariaDBServer, lock_waits, wait_until
from keyexpiry.errors import StoreError
from keyexpiry.keys import driver_lock_key
from keyexpiry.ledger.store import NewTask, Store, TaskRow, TaskStatus, make_engine
from tests import sample_tasks
from tests.conftest import MariaDBFactory, RedisFactory
from tests.faults.spawn import ROOT, Spawned, listener_env, signal_group
from tests.ke import Running, make_settings, wait_status
from tests.reliability import Verdict

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]


def test_listener_killed_mid_handler_is_run_again_elsewhere(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyexpiry", "listen"],
        cwd=ROOT,
        env=listener_env(settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # hang_first blocks on its first attempt (in that process): kill it right there.
        key = client.create("Probe.hang_first", "crash", ttl_ms=100)
        wait_status(client, key, TaskStatus.RUNNING, timeout_s=20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    start_listener(settings)
    row = wait_status(client, key, TaskStatus.DONE, timeout_s=20)
    assert row.attempts == 2  # the first attempt died with its listener
    assert sample_tasks.CALLS[key] == 1  # the second ran here
    # The handler started twice (the documented crash window): at least once.
    verdict.check(client, [key], at_least_once=True, calls={key: row.attempts})


def test_listener_killed_with_60s_handlers_is_taken_over_in_seconds(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    """kill -9 of a listener whose handlers have a 60 s timeout (lease 61 s): a live peer
    notices the silent heartbeat (default 1 s beats, 5 s takeover) and runs them again."""
    env = {**listener_env(settings), "KEYEXPIRY_CONCURRENCY": "4"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyexpiry", "listen"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    keys: list[str] = []
    try:
        keys = [client.create("Probe.stall", f"k{i}", ttl_ms=50) for i in range(4)]
        for key in keys:
            sample_tasks.gate(key.rsplit("@", 1)[1]).set()  # here they return at once
            wait_status(client, key, TaskStatus.RUNNING, timeout_s=20)
        start_listener(settings)  # the peer that will take over
        kill_ms = client.clock.now_ms()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for key in keys:
        wait_status(client, key, TaskStatus.DONE, timeout_s=30)
    row = verdict.check(
        client,
        keys,
        fault_at_ms=kill_ms,
        at_least_once=True,
        calls={k: r.attempts for k, r in client.store.get_many(keys).items()},
    )
    # From the kill to the last rerun's end: about the 5 s takeover; the lease was 61 s.
    assert row.recover_s <= 15, row
    assert all(r.attempts == 2 for r in client.store.get_many(keys).values())


def test_listener_paused_past_the_heartbeat_window_loses_nothing_when_resumed(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    spawn: Spawned,
    tmp_path: Path,
    verdict: Verdict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listener frozen (SIGSTOP) for longer than the takeover window with runs in progress,
    while more tasks fall due: a peer takes its runs over and runs the new ones; resumed, the
    frozen listener beats again, its taken-over runs cannot record over the peer's, and no
    task is lost or run twice beyond the documented window (the runs it held)."""
    runs = tmp_path / "runs.txt"
    monkeypatch.setenv(sample_tasks.RUNS_FILE_ENV, str(runs))  # the peer logs its runs too
    proc, log = spawn.listen(settings, **{sample_tasks.RUNS_FILE_ENV: str(runs)})
    held = [client.create("Probe.stall", f"held{i}", ttl_ms=50) for i in range(3)]
    for key in held:
        sample_tasks.gate(key.rsplit("@", 1)[1]).set()  # here they return at once
        wait_status(client, key, TaskStatus.RUNNING, timeout_s=20)
    peer = start_listener(settings)
    frozen = next(r.id for r in client.store.listeners() if r.id != peer.listener.owner)
    signal_group(proc, signal.SIGSTOP)
    paused_ms = client.clock.now_ms()
    fresh = client.create_many(
        TaskRequest("Probe.logged", (f"fresh{i}",), ttl_ms=200 + 20 * i) for i in range(50)
    )
    for key in held:
        wait_status(client, key, TaskStatus.DONE, timeout_s=20)
    # The peer took the frozen runs over: their second attempt ran here. Its count of takeovers
    # may lag: a SIGSTOP that lands inside the frozen listener's heartbeat transaction keeps that
    # row locked until it resumes, so the row's removal (and the count) waits (seen in CI: the
    # DELETE hit MariaDB's lock wait timeout while the requeued runs were already done).
    taken = client.store.get_many(held)
    assert all((r.claimed_by or "").startswith(peer.listener.owner) for r in taken.values()), taken
    assert peer.listener.fleet.takeovers <= 1
    signal_group(proc, signal.SIGCONT)
    wait_until(
        lambda: frozen in [r.id for r in client.store.listeners()],
        10,
        message="the resumed listener never beat again",
    )
    for key in fresh:
        wait_status(client, key, TaskStatus.DONE, timeout_s=20)
    logged = sample_tasks.runs_in(runs)
    assert all(logged[k] == 1 for k in fresh), {k: logged[k] for k in fresh if logged[k] != 1}
    rows = client.store.get_many(held)
    assert all(r.status is TaskStatus.DONE and r.attempts == 2 for r in rows.values()), rows
    calls = {**{k: logged[k] for k in fresh}, **{k: r.attempts for k, r in rows.items()}}
    verdict.check(client, held + fresh, fault_at_ms=paused_ms, at_least_once=True, calls=calls)
    assert proc.poll() is None, log.read_text()[-3000:]


def test_database_down_during_create_is_a_clear_error_and_leaves_no_key(
    mariadb_factory: MariaDBFactory, redis_url: str, tmp_path: Path
) -> None:
    server = mariadb_factory()
    cfg = make_settings(redis_url, server.create_database("faults"), tmp_path)
    with Client(cfg) as c:
        server.stop()
        with pytest.raises(StoreError, match="database"):
            c.create("Probe.record", "no-db", ttl_s=60)
        assert c.redis.exists("Probe@record@no-db") == 0
        server.start()
        assert c.create("Probe.record", "no-db", ttl_s=60) == "Probe@record@no-db"


def test_database_down_while_tasks_are_due(
    mariadb_factory: MariaDBFactory,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    server = mariadb_factory()
    cfg = make_settings(redis_url, server.create_database("faults"), tmp_path)
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"nodb{i}",), ttl_ms=300 + 20 * i) for i in range(20)
        )
        server.stop()
        wait_until(lambda: _all_due(c, keys), 10)
        server.start()
        verdict.check(c, keys, since_ms=c.clock.now_ms())


def _all_due(c: Client, keys: list[str]) -> bool:
    # The ledger is down, so Redis says when they are due: every key has expired.
    return int(c.redis.exists(*keys)) == 0


RACE_TASKS = 1000
RACE_THREADS = 10


@dataclass(frozen=True)
class Raced:
    """One task of a race: when it was due, how far from due the action was issued, and its
    answer."""

    key: str
    due_ms: int
    offset_ms: int
    answer: object


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


class RunsAt(Mapping[str, int]):
    """Runs of each key claimed for the given due time, read when asked (after the wait)."""

    def __init__(self, dues: Mapping[str, int]) -> None:
        self.dues = dues

    def __getitem__(self, key: str) -> int:
        return sample_tasks.RUN_DUES.get(key, []).count(self.dues[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.dues)

    def __len__(self) -> int:
        return len(self.dues)


def _race(
    client: Client,
    name: str,
    act: Callable[[str, random.Random], object],
    won: Callable[[Raced], bool],
) -> list[Raced]:
    """Create RACE_TASKS tasks due in 20-40 ms and `act(arg, rng)` on each within a few ms of
    the instant its claim happens, on the Redis clock; RACE_THREADS tasks in flight at once.

    The claim comes a few ms after the due time, how many depends on the machine and its load
    (tens of ms under a full test run on two cores); acting at due +/- 3 ms would mostly act
    first and nothing would race. So each thread aims at due + a centre + a random -3..+3 ms, and
    moves its centre later after its previous task was won by the action (`won`), earlier after
    it was lost, by a quarter of itself (at least 1 ms): the centre settles where either may win.
    It may go as early as 50 ms before due: under a full test run the action itself (a cancel's
    round trips) can take longer than the claim comes after the due time.
    """

    def worker(n: int) -> list[Raced]:
        rng = random.Random(n)
        out: list[Raced] = []
        centre_ms = 0
        for i in range(RACE_TASKS // RACE_THREADS):
            if out:
                step = max(1, abs(centre_ms) // 4)
                centre_ms = max(-50, min(centre_ms + (step if won(out[-1]) else -step), 200))
            arg = f"{name}{n}-{i}"
            due = client.clock.now_ms() + rng.randint(20, 40)
            key = client.create("Probe.record", arg, at=_utc(due))
            target = due + centre_ms + rng.randint(-3, 3)
            while (left_ms := target - client.clock.now_ms()) > 0:
                time.sleep(left_ms / 1000)
            issued = client.clock.now_ms()
            out.append(Raced(key, due, issued - due, act(arg, rng)))
        return out

    with ThreadPoolExecutor(RACE_THREADS) as pool:
        return [r for rs in pool.map(worker, range(RACE_THREADS)) for r in rs]


def _spread(raced: list[Raced], won: Callable[[Raced], bool]) -> str:
    """Per actual offset from due: how many the action won / lost (for failure messages)."""
    by: dict[int, list[int]] = {}
    for r in raced:
        by.setdefault(r.offset_ms, [0, 0])[0 if won(r) else 1] += 1
    return ", ".join(f"{o:+d} ms: {w}/{w + lo}" for o, (w, lo) in sorted(by.items()))


def test_cancel_racing_expiry_is_truthful(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    """Cancel issued within a few ms of the due time: cancel or the claim wins, never both.

    True means the task is cancelled and never runs; False means it was claimed and runs once.
    """
    start_listener(settings)
    raced = _race(
        client,
        "cancel",
        lambda arg, _rng: client.cancel("Probe.record", arg),
        won=lambda r: r.answer is True,
    )
    cancelled = [r.key for r in raced if r.answer is True]
    ran = [r.key for r in raced if r.answer is False]
    spread = _spread(raced, lambda r: r.answer is True)
    verdict.check(client, ran, cancelled=cancelled, timeout_s=30)
    # Both outcomes in numbers, or nothing raced (all cancelled early, or all claimed first).
    assert min(len(cancelled), len(ran)) >= RACE_TASKS * 0.05, spread
    print(f"cancel won at offset from due: {spread}")


def test_reschedule_racing_expiry_runs_once_at_the_new_due(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    """Creating a task again within a few ms of its due time moves it, or adds a run.

    `create` on an existing key makes exactly one run happen at (or after) the new due time. If
    the old due time's claim committed first, that run happens as well (once, and never after
    the reschedule); otherwise the old due time never runs. Nothing else runs.
    """
    start_listener(settings)
    new_dues: dict[str, int] = {}

    def reschedule(arg: str, rng: random.Random) -> object:
        due = client.clock.now_ms() + rng.randint(150, 300)
        key = client.create("Probe.record", arg, at=_utc(due))
        new_dues[key] = due
        return due

    # The previous task's old run, if claimed, has run by the time the next one is due.
    def moved_first(r: Raced) -> bool:
        return r.due_ms not in sample_tasks.RUN_DUES.get(r.key, [])

    raced = _race(client, "move", reschedule, won=moved_first)
    keys = [r.key for r in raced]
    verdict.check(client, keys, calls=RunsAt(new_dues), timeout_s=30)
    runs = {k: sample_tasks.RUN_DUES.get(k, []) for k in keys}
    old_ran = {r.key for r in raced if not moved_first(r)}
    for r in raced:
        assert runs[r.key].count(r.due_ms) <= 1, (r, runs[r.key])
        assert set(runs[r.key]) <= {r.due_ms, new_dues[r.key]}, (r, runs[r.key])
    spread = _spread(raced, moved_first)
    assert RACE_TASKS * 0.05 <= len(old_ran) <= RACE_TASKS * 0.95, spread
    print(f"reschedule won at offset from due: {spread}")


def test_a_create_chosen_as_a_deadlock_victim_is_run_again(
    mysql_url: str, mariadb_server: MariaDBServer
) -> None:
    """Rescheduling a key deadlocks with a claim of the same row now and then (the race above
    found it): InnoDB rolls one back and expects it to be run again. Staged here: a heavier
    transaction holds the row shared, the create waits to lock it, then the other asks for it
    exclusively: a deadlock whose victim is the lighter one, the create."""
    store = Store(make_engine(mysql_url))
    store.create_schema()
    task = NewTask("Probe@record@a", "Probe", "record", ("a",), 1_000)
    fill = [NewTask(f"Probe@record@f{i}", "Probe", "record", (f"f{i}",), 1_000) for i in range(200)]
    store.upsert_pending([task, *fill], 1_000)
    other = mariadb_server.admin_connection(database=mysql_url.rsplit("/", 1)[1])
    watcher = mariadb_server.admin_connection()
    errors: list[BaseException] = []

    def reschedule() -> None:
        try:
            store.upsert_pending([replace(task, due_at_ms=5_000)], 2_000)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reschedule)
    try:
        with other.cursor() as cur:
            # As the listener runs: no gap locks, which would stop the create for another reason.
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cur.execute("BEGIN")
            cur.execute("UPDATE time_limit_task SET attempts = 1 WHERE id > 1")  # the heavier
            cur.execute("SELECT id FROM time_limit_task WHERE id = 1 LOCK IN SHARE MODE")
            thread.start()
            # InnoDB refreshes this view only when nobody read it for 100 ms: poll slowly.
            wait_until(lambda: lock_waits(watcher) == 1, 10, interval_s=0.2)
            cur.execute("UPDATE time_limit_task SET attempts = 2 WHERE id = 1")
            cur.execute("COMMIT")  # the create's second run can go on
        thread.join(30)
    finally:
        other.close()
        watcher.close()
        store.engine.dispose()
    assert not errors, errors
    row = store.get(task.key)
    assert row is not None and row.due_at_ms == 5_000


@pytest.mark.xdist_group("heavy")
def test_a_killed_driver_is_replaced_within_its_lease(
    redis_url: str, sqlite_url: str, tmp_path: Path, spawn: Spawned
) -> None:
    """kill -9 of the listener that drives expiries: a peer holds the lock within the lease
    (2 s) and its retry (0.5 s). On a 5 s lease every listener's tasks due in the next 4 s
    waited for Redis's own sweep (the Cluster soak's kill -9 of the driver). The lock is
    Redis's: one ledger is enough."""
    settings = make_settings(redis_url, sqlite_url, tmp_path)
    (first, _), (second, _) = spawn.listen_many(settings, 2)
    client = Client(settings)
    lock = driver_lock_key(settings.key_prefix)
    wait_until(lambda: client.redis.get(lock) is not None, 10)
    owner = client.redis.get(lock)
    driver_pid = int(owner.decode().split(":")[-2])  # host:pid:nonce
    assert driver_pid in (first.pid, second.pid), owner
    victim, survivor = (first, second) if driver_pid == first.pid else (second, first)
    # Killed just after a renewal: the whole lease is left to run out.
    wait_until(lambda: int(client.redis.pttl(lock)) > 1850, 5, interval_s=0.005)
    killed_s = time.monotonic()
    signal_group(victim, signal.SIGKILL)
    wait_until(lambda: client.redis.get(lock) not in (None, owner), 15, interval_s=0.01)
    took_s = time.monotonic() - killed_s
    assert f":{survivor.pid}:" in client.redis.get(lock).decode()
    # The lease and a retry, 0.5 s to spare for a loaded machine.
    assert took_s <= 3.0, took_s
    client.close()


def test_three_listeners_share_a_load_without_double_runs(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    # The default handler timeout, not the suite's 10 s: a lease sized by it is what a run's
    # outcome must be written within, and three listeners in one process on a starved 2-core
    # machine (SQLite, one writer) took longer than 10 s; a peer then ran such runs again. That
    # is the documented slow-listener window, not the sharing this scenario checks.
    settings = replace(settings, handler_timeout_s=60.0)
    listeners = [start_listener(settings) for _ in range(3)]
    # Four tasks due each millisecond for a second, shared by three listeners in one process.
    # (It was 10,000: 35 s of a `make test` worker on PostgreSQL, on a suite over its budget.)
    n = 4_000
    keys = client.create_many(
        TaskRequest("Probe.record", (f"three{i}",), ttl_ms=1000 + i % 1000) for i in range(n)
    )
    verdict.check(client, keys, timeout_s=120)
    # Stats count after the ledger write, so wait for them rather than read them at once.
    wait_until(lambda: sum(r.listener.dispatcher.stats.done for r in listeners) == n, 10)
    # Shared, not one listener doing it all while the others lose every race.
    assert all(r.listener.dispatcher.stats.done > 0 for r in listeners), [
        r.listener.dispatcher.stats.done for r in listeners
    ]


def test_one_of_three_listeners_killed_under_load(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    spawn: Spawned,
    tmp_path: Path,
    verdict: Verdict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kill -9 of one of three listeners while 3,000 tasks fall due over 3 s: the other two
    take over its runs (heartbeat) and its share of the events (every listener hears every
    event); only the runs it had started may run twice."""
    runs = tmp_path / "runs.txt"
    monkeypatch.setenv(sample_tasks.RUNS_FILE_ENV, str(runs))
    victim, _ = spawn.listen(settings, **{sample_tasks.RUNS_FILE_ENV: str(runs)})
    _, survivor_log = spawn.listen(settings, **{sample_tasks.RUNS_FILE_ENV: str(runs)})
    here = start_listener(settings)
    # 1,000 due a second, not 2,000: recovery is the survivors draining what the kill left, and
    # at 6,000 a CI machine busy with three other workers drained it at under 300 a second
    # (recovered in 16 s on MariaDB and SQLite alike, the in-process listener 3 s behind before
    # the kill): a throughput figure, which is the benchmark's, not this scenario's.
    n = 3000
    keys = client.create_many(
        TaskRequest("Probe.logged", (f"load{i}",), ttl_ms=500 + i) for i in range(n)
    )
    wait_until(lambda: sum(sample_tasks.runs_in(runs).values()) > n // 4, 20)
    kill_ms = client.clock.now_ms()
    signal_group(victim, signal.SIGKILL)
    calls = RunsFile(runs)
    row = verdict.check(
        client, keys, fault_at_ms=kill_ms, at_least_once=True, calls=calls, timeout_s=60
    )
    # On failure, say which part was slow: the takeover (heartbeat) or the drain after it.
    rows = client.store.get_many(keys)
    taken = [line[:23] for line in survivor_log.read_text().splitlines() if "took over" in line]

    def behind(r: TaskRow) -> bool:
        return r.attempts == 1 and r.due_at_ms < kill_ms - 500 and (r.started_at_ms or 0) > kill_ms

    reruns = sorted((r.started_at_ms or 0) - kill_ms for r in rows.values() if r.attempts > 1)
    assert row.recover_s <= 15, (
        row,
        f"takeovers: in-process {here.listener.fleet.takeovers}, spawned at {taken}",
        f"second attempts started {reruns[:1]}..{reruns[-1:]} ms after the kill",
        f"behind at the kill: {sum(map(behind, rows.values()))} due over 0.5 s before it, first"
        " started after it",
    )
    # Only what the victim held (running, or finished with its outcome not yet written) runs
    # again, and then as a second attempt after a takeover: never two claims of one attempt.
    twice = [k for k in keys if calls.get(k, 0) > 1]
    assert all(rows[k].attempts == calls[k] for k in twice), [rows[k] for k in twice[:3]]


def test_a_listener_joining_under_load_shares_it_without_double_runs(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    spawn: Spawned,
    tmp_path: Path,
    verdict: Verdict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = tmp_path / "runs.txt"
    monkeypatch.setenv(sample_tasks.RUNS_FILE_ENV, str(runs))
    first = start_listener(settings)
    keys = client.create_many(
        # Due over 8 s: the newcomer (a process that imports, connects and subscribes under
        # load) joins with most of the work still ahead.
        TaskRequest("Probe.logged", (f"join{i}",), ttl_ms=300 + i)
        for i in range(8000)
    )
    wait_until(lambda: sum(sample_tasks.runs_in(runs).values()) > 500, 20)
    spawn.listen(settings, **{sample_tasks.RUNS_FILE_ENV: str(runs)})
    # Joined: it beats, so it is one of the fleet (until listeners partition the work it only
    # races the first one for claims, and under load may win none: that is issue 12's part 2).
    wait_until(lambda: len(client.store.listeners()) == 2, 10, message="the newcomer never beat")
    assert first.listener.owner in {r.id for r in client.store.listeners()}
    verdict.check(client, keys, calls=RunsFile(runs), timeout_s=60)


STOPPED_TASKS = 100_000
# 100k expired events are about 6 MB on the subscriber's socket, under Redis's default hard
# limit of 32 MB: lowered so that stopping the listener makes Redis drop it, as a real backlog of
# a few million events would.
_SMALL_PUBSUB_BUFFER = ["--client-output-buffer-limit", "pubsub", "1mb", "256kb", "1"]


class RunsFile(Mapping[str, int]):
    """Runs per key that `Probe.logged` wrote to a file (or to several, one per listener,
    summed), read once on first use (after the wait: a run is in the file before its outcome
    reaches the ledger)."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths
        self._counts: Mapping[str, int] | None = None

    def _read(self) -> Mapping[str, int]:
        if self._counts is None:
            total: Counter[str] = Counter()
            for path in self.paths:
                total += sample_tasks.runs_in(path)
            self._counts = total
        return self._counts

    def __getitem__(self, key: str) -> int:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


# ~70 s on an idle 2-core machine (100k rows written, expired and run): the suite's 120 s
# limit is too close when the machine is shared.
@pytest.mark.xdist_group("heavy")
@pytest.mark.timeout(300)
def test_listener_stopped_while_100k_tasks_expire_catches_up(
    redis_factory: RedisFactory, mysql_url: str, tmp_path: Path, spawn: Spawned, verdict: Verdict
) -> None:
    """Scenario 12: the listener is frozen (SIGSTOP) while 100k tasks fall due. Its unread
    events pass Redis's pubsub output limit and Redis closes the connection, so those events
    are gone for good. After SIGCONT the listener notices, reconnects, reconciles from the
    ledger and runs every task exactly once."""
    server = redis_factory(args=_SMALL_PUBSUB_BUFFER)
    runs = tmp_path / "runs.txt"
    cfg = make_settings(server.url(), mysql_url, tmp_path)
    with Client(cfg) as c:
        proc, log = spawn.listen(cfg, **{sample_tasks.RUNS_FILE_ENV: str(runs)})
        signal_group(proc, signal.SIGSTOP)
        keys = c.create_many(
            TaskRequest("Probe.logged", (f"stop{i}",), ttl_ms=1000 + i % 1000)
            for i in range(STOPPED_TASKS)
        )
        wait_until(lambda: _none_left(c, keys), 60, message="Redis never expired the tasks")
        wait_until(
            lambda: "output buffer limits" in server.log_path.read_text(),
            10,
            message=f"Redis never dropped the stopped subscriber:\n{server.log_tail()}",
        )
        assert not runs.exists()  # nothing ran while the listener was stopped
        since_ms = c.clock.now_ms()
        signal_group(proc, signal.SIGCONT)
        verdict.check(c, keys, since_ms=since_ms, calls=RunsFile(runs), timeout_s=240)
        assert proc.poll() is None, log.read_text()[-3000:]
        # The gap was noticed: redis-py re-subscribed on its own (its connect callback), or the
        # read failed and the listener subscribed again itself; either way it reconciled.
        text = log.read_text()
        assert (
            "re-established after a dropped connection" in text
            or "subscribed to __keyevent@0__:expired (reconnect)" in text
        ), text[-3000:]


def _none_left(c: Client, keys: list[str]) -> bool:
    return all(c.redis.exists(*keys[i : i + 10_000]) == 0 for i in range(0, len(keys), 10_000))

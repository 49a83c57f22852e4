"""`bench --scenario soak`: steady load for minutes, a fault every minute, a verdict from history.

The set-up a production fleet has: Redis behind Sentinel (master, replica, three sentinels) or a
Redis Cluster (`soak_redis`), MariaDB or PostgreSQL (`--backend`), three listener processes that a
supervisor restarts when they die (as systemd's `Restart=always` would). On Sentinel two
listeners speak Sentinel; the third reaches Redis through HAProxy (a `role:master` check), as
clients that do not speak Sentinel do, which is also where the network stall is made: SIGSTOP of
that HAProxy. On a Cluster every listener speaks Cluster, the stall is a primary paused, and
slots move between primaries under load.

A producer thread creates a steady stream (plain batches, tagged tasks, tasks created in a
transaction), reschedules and cancels some of them, and writes what it did to
`produced.jsonl` once each call returned. Handlers write each start and end to `runs-*.jsonl`
(`soak_tasks`). Faults run one a minute in rotation and are written to `faults.jsonl` with their
start and end; every 10 s each listener's RSS, descriptors, threads and connections, Redis's
memory and the ledger's rows are written to `samples.jsonl`. `soak_verdict` reads only these
files (and nothing from the listeners' logs) to decide every task's fate.

Long because it is one scenario's runner. `SoakConfig` and the run directory's
files tie its parts together (the fleet, the producer, the fault rotation, the samplers, the
report), and none is used elsewhere; reading the history back and judging it are modules of
their own (`soak_history`, `soak_verdict`), as is the Redis side (`soak_redis`). Should a part
grow or be reused, `Fleet` and `Producer` (with `SoakConfig` and `_Lines` beneath them) are the
seams.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil
import redis
import sqlalchemy as sa

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.harness import machine, redis_server_binary
from keyexpiry.bench.servers import (
    LOOPBACK,
    MariaDBServer,
    PostgresServer,
    free_port,
    wait_until,
)
from keyexpiry.bench.servers.netns import NetNamespace
from keyexpiry.bench.servers.patroni import PatroniCluster
from keyexpiry.bench.soak_redis import SENTINEL_FAULTS, soak_redis
from keyexpiry.bench.soak_tasks import HISTORY_DIR_ENV, Soak, kind
from keyexpiry.errors import RedisUnavailableError, StoreError
from keyexpiry.keys import driver_lock_key

FAULTS = SENTINEL_FAULTS
"""The rotation on Sentinel, one fault per slot; FLUSHALL happens once per run, later turns skip
it (`soak_redis.CLUSTER_FAULTS` on a Cluster)."""
RETRY_SCHEDULE_S = (0.5, 1.0)
"""Two retries: a dead-by-design task starts three times."""


@dataclass
class SoakConfig:
    """What a soak run does; `quick()` is the two-minute version."""

    minutes: float = 10.0
    rate_per_s: int = 500
    max_due_s: float = 300.0
    min_due_s: float = 0.1
    fault_every_s: float = 60.0
    warm_up_s: float = 120.0
    sample_every_s: float = 10.0
    listeners: int = 3
    concurrency: int = 16
    retain_done_s: float = 60.0
    prune_every_s: float = 10.0
    settle_s: float = 10.0
    sigstop_s: float = 20.0
    """How long the SIGSTOP fault freezes a listener."""
    stall_s: float = 10.0
    """How long the network stall (HAProxy stopped) lasts."""
    seed: int = 1
    faults: tuple[str, ...] | None = None
    """The rotation; None: the Redis's own (`soak_redis`)."""
    ledger: str = "mariadb"
    """The ledger: `mariadb` or `postgres` (restarted by the `ledger_restart` fault), or
    `patroni` / `patroni-sync`: PostgreSQL primary and standby under Patroni, asynchronous or
    synchronous replication, whose faults replace the restart (`PATRONI_FAULTS`)."""
    redis: str = "sentinel"
    """The Redis: `sentinel` or `cluster`."""
    network: bool = False
    """One listener (`NET_SLOT`) in a network namespace of its own, and the network faults
    (`NET_FAULTS`) in the rotation (needs root, `ip` and `iptables`)."""
    net_fault_s: float = 20.0
    """How long each network fault lasts."""

    @classmethod
    def quick(cls, minutes: float = 2.0) -> SoakConfig:
        """Two minutes, due at most 30 s ahead, a fault every 15 s (the whole rotation)."""
        return cls(minutes=minutes, max_due_s=30.0, fault_every_s=15.0, warm_up_s=30.0)


def _kill_pubsub(client: redis.Redis) -> int:
    """CLIENT KILL TYPE pubsub; how many it killed."""
    return int(client.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))  # type: ignore[no-untyped-call]


def _redis_description(kind: str) -> str:
    from keyexpiry.bench.soak_redis import ClusterRedis, SentinelRedis

    text = (ClusterRedis if kind == "cluster" else SentinelRedis).description
    return text[0].upper() + text[1:]


NET_FAULTS = ("net_partition_redis", "net_partition_ledger", "net_latency")
"""With `SoakConfig.network`, what the namespaced listener's network goes through: every packet
to and from the Redis servers dropped, the same for the ledger, then 200 ms ± 100 ms delay and
5 % loss on all of it (`servers.netns`). Each follows one of the first three faults."""
NET_SLOT = 1
"""The listener in the namespace: one that speaks Sentinel (slot 2 goes through HAProxy)."""
PATRONI_FAULTS = ("pg_kill_primary", "pg_switchover", "etcd_leader_lost")
"""What a Patroni ledger goes through in place of `ledger_restart`."""
LOST_COMMIT_WINDOW_MS = 2000
"""With asynchronous replication, how long before a primary's loss a commit it answered may be
missing on the promoted standby (the verdict's documented window; Patroni promotes a standby
at most `maximum_lag_on_failover` behind)."""


def ledger_name(ledger: str) -> str:
    """How the report names the ledger's engine."""
    if ledger.startswith("patroni"):
        mode = "synchronous" if ledger == "patroni-sync" else "asynchronous"
        return f"PostgreSQL under Patroni ({mode} replication)"
    return "PostgreSQL" if ledger == "postgres" else "MariaDB"


def _ledger_version(ledger: str, m: dict[str, Any]) -> str:
    """`10.11.19-MariaDB-0+deb12u1` or `PostgreSQL 15.14`, from the machine's server lines."""
    if ledger == "postgres" or ledger.startswith("patroni"):
        return f"PostgreSQL {str(m.get('postgres', '?')).split()[-1]}"
    return str(m.get("mariadb", "?")).split(" Ver ")[-1].split(" for ")[0]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _remote_ports(pid: int) -> list[int]:
    """The remote ports of `pid`'s connected TCP sockets, read from its own network namespace's
    tables (psutil reads this process's, and so sees none of a listener in another namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    ports = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)  # the header
            for line in lines:
                fields = line.split()
                port = int(fields[2].rsplit(":", 1)[1], 16)
                if int(fields[9]) in inodes and port and fields[3] != "0A":  # 0A: listening
                    ports.append(port)
    return ports


class _Lines:
    """A JSON-lines file written from several threads."""

    def __init__(self, path: Path) -> None:
        self._out: TextIO = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, line: dict[str, Any]) -> None:
        with self._lock:
            self._out.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._out.close()


@dataclass
class _Slot:
    """One supervised listener: its current process and its log."""

    index: int
    redis_url: str
    db_url: str
    log: Path
    http_port: int
    proc: subprocess.Popen[bytes] | None = None
    started_ms: int = 0
    frozen: bool = False
    netns: NetNamespace | None = None
    """The network namespace it runs in, if any."""

    @property
    def http_host(self) -> str:
        """Where its HTTP port listens: in a namespace, that namespace's own address."""
        return self.netns.address if self.netns else LOOPBACK


class Fleet:
    """The listener processes, restarted by a supervisor thread whenever one exits."""

    def __init__(
        self,
        run_dir: Path,
        db_urls: list[str],
        redis_urls: list[str],
        cfg: SoakConfig,
        netns: NetNamespace | None = None,
    ) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        self.slots = [
            _Slot(
                i,
                url,
                db_urls[min(i, len(db_urls) - 1)],
                run_dir / f"listener-{i}.log",
                free_port(),
            )
            for i, url in enumerate(redis_urls)
        ]
        if netns is not None:
            if len(self.slots) <= NET_SLOT:
                raise ValueError(f"a network namespace needs {NET_SLOT + 1} listeners or more")
            self.slots[NET_SLOT].netns = netns
        self.incarnations = _Lines(run_dir / "listeners.jsonl")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)

    def env(self, slot: _Slot) -> dict[str, str]:
        """The listener's settings: production defaults but short retention and retries."""
        cfg = self.cfg
        return {
            **os.environ,
            HISTORY_DIR_ENV: str(self.run_dir),
            "KEYEXPIRY_TASKS": "keyexpiry.bench.soak_tasks",
            "KEYEXPIRY_REDIS_URL": slot.redis_url,
            "KEYEXPIRY_DATABASE_URL": slot.db_url,
            "KEYEXPIRY_CONCURRENCY": str(cfg.concurrency),
            "KEYEXPIRY_RETRY_SCHEDULE_S": ",".join(map(str, RETRY_SCHEDULE_S)),
            "KEYEXPIRY_RETAIN_DONE_S": str(cfg.retain_done_s),
            "KEYEXPIRY_RETAIN_DEAD_S": str(cfg.retain_done_s),
            "KEYEXPIRY_PRUNE_EVERY_S": str(cfg.prune_every_s),
            "KEYEXPIRY_LOG_LEVEL": "WARNING",
            # /readyz says when a restarted or resumed listener runs tasks again.
            "KEYEXPIRY_HTTP": f"{slot.http_host}:{slot.http_port}",
        }

    def start(self) -> None:
        """Start every listener, then the supervisor."""
        for slot in self.slots:
            self._spawn(slot)
        self._thread.start()

    def _spawn(self, slot: _Slot) -> None:
        with slot.log.open("ab") as out:
            argv = [sys.executable, "-m", "keyexpiry", "listen"]
            slot.proc = subprocess.Popen(
                # `ip netns exec` execs the listener: the pid is the listener's own.
                slot.netns.command(argv) if slot.netns else argv,
                env=self.env(slot),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        slot.started_ms = _now_ms()
        self.incarnations.write(
            {"slot": slot.index, "pid": slot.proc.pid, "started_ms": slot.started_ms}
        )

    def _supervise(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                for slot in self.slots:
                    if slot.proc is not None and slot.proc.poll() is not None:
                        self.incarnations.write(
                            {
                                "slot": slot.index,
                                "pid": slot.proc.pid,
                                "ended_ms": _now_ms(),
                                "returncode": slot.proc.returncode,
                            }
                        )
                        self._spawn(slot)

    def signal(self, index: int, signum: int) -> int:
        """Send `signum` to slot `index`'s process group; its pid."""
        with self._lock:
            proc = self.slots[index].proc
            assert proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
            return proc.pid

    def ready(self) -> bool:
        """Whether every listener's /readyz answers 200 (subscribed, events arriving, ledger
        answering)."""
        for slot in self.slots:
            try:
                url = f"http://{slot.http_host}:{slot.http_port}/readyz"
                with urllib.request.urlopen(url, timeout=1.0) as answer:
                    if answer.status != 200:
                        return False
            except OSError:
                return False
        return True

    def pids(self) -> list[tuple[_Slot, int]]:
        """(slot, pid) of each listener process now."""
        with self._lock:
            return [(s, s.proc.pid) for s in self.slots if s.proc is not None]

    def stop(self) -> None:
        """Stop the supervisor, then SIGTERM every listener (SIGKILL after 30 s)."""
        self._stop.set()
        self._thread.join()
        for slot in self.slots:
            if slot.proc is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(slot.proc.pid, signal.SIGCONT)
                os.killpg(slot.proc.pid, signal.SIGTERM)
            try:
                slot.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(slot.proc.pid, signal.SIGKILL)
                slot.proc.wait()
        self.incarnations.close()


@dataclass
class _Recent:
    """A task the producer may still reschedule or cancel."""

    i: int
    due_ms: int
    tag: str | None


@dataclass
class Producer:
    """Creates `rate_per_s` tasks a second in 100 ms ticks; reschedules, cancels, cancels tags."""

    ke: Client
    cfg: SoakConfig
    out: _Lines
    stop_at: float
    rng: random.Random = field(default_factory=random.Random)
    next_id: int = 0
    errors: int = 0
    created: int = 0
    _recent: deque[_Recent] = field(default_factory=lambda: deque(maxlen=20_000))
    _tags: dict[str, list[int]] = field(default_factory=dict)
    _tag_due_ms: dict[str, int] = field(default_factory=dict)

    TICK_S = 0.1
    MARGIN_MS = 2000
    """Only tasks due at least this far ahead are rescheduled or cancelled (and moved at least
    this far): a reschedule never races the run it replaces (GUARANTEES window 3)."""

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop_at` (monotonic) or `stop`."""
        tick = 0
        next_at = time.monotonic()
        while not stop.is_set() and time.monotonic() < self.stop_at:
            self._tick(tick)
            tick += 1
            next_at += self.TICK_S
            stop.wait(max(0.0, next_at - time.monotonic()))

    def _due_s(self) -> float:
        # Log-uniform between min and max: most tasks due within seconds, a few minutes ahead.
        lo, hi = math.log(self.cfg.min_due_s), math.log(self.cfg.max_due_s)
        return math.exp(self.rng.uniform(lo, hi))

    def _tick(self, tick: int) -> None:
        n = max(1, round(self.cfg.rate_per_s * self.TICK_S))
        tagged = max(1, n // 10)
        in_tx = max(1, n // 10)
        plain = n - tagged - in_tx
        self._create([self._request(None) for _ in range(plain)], "plain")
        tag = f"soak:{tick}"
        self._create([self._request(tag) for _ in range(tagged)], "tag")
        self._create([self._request(None) for _ in range(in_tx)], "tx")
        for _ in range(max(1, n // 50)):
            self._reschedule()
        for _ in range(max(1, n // 100)):
            self._cancel()
        if tick % 20 == 10:
            self._cancel_tag()

    def _request(self, tag: str | None) -> tuple[int, TaskRequest]:
        i = self.next_id
        self.next_id += 1
        return i, TaskRequest(Soak.run, (i,), ttl_ms=max(1, int(self._due_s() * 1000)), tag=tag)

    def _retrying(self, what: str, fn: Callable[[], Any]) -> tuple[Any, int]:
        """Call `fn` until it returns (a real producer retries: a repeated create is safe);
        return its value and how many calls failed. A minute past the end of production it
        gives up (raises): a server gone for good must not hang the run."""
        failed = 0
        while True:
            try:
                return fn(), failed
            except Exception as exc:  # any outage: retry as a producer would
                if time.monotonic() > self.stop_at + 60:
                    raise
                failed += 1
                self.errors += 1
                if failed in (1, 10, 100):
                    print(f"  producer: {what} failed ({failed}x): {exc!r:.200}", flush=True)
                time.sleep(0.2)

    def _create(self, batch: list[tuple[int, TaskRequest]], via: str) -> None:
        requests = [r for _, r in batch]
        ambiguous = recorded = unarmed = False
        keys = [self.ke.key_for(r.target, *r.args) for r in requests]

        def read_back() -> list[int]:
            rows = self.ke.store.get_many(keys)
            return [rows[k].due_at_ms for k in keys]

        def create() -> list[int]:
            nonlocal ambiguous, recorded, unarmed
            if recorded:
                return read_back()
            try:
                if via != "tx":
                    return [s.due_at_ms for s in self.ke.create_many(requests)]
                with self.ke.store.engine.connect() as conn:
                    transaction = conn.begin()
                    dues = [s.due_at_ms for s in self.ke.create_many(requests, tx=conn)]
                    try:
                        transaction.commit()
                    except sa.exc.DBAPIError:
                        # The connection lost during COMMIT: it may have committed (seen in
                        # CI at a MariaDB restart), so the retry is window 3, as a StoreError's.
                        ambiguous = True
                        raise
                    return dues
            except RedisUnavailableError:
                # Recorded, its key not set: reconciliation arms it. Creating it again could
                # run it twice (GUARANTEES window 3), so read the due times back instead, and
                # only that on a retry. The verdict is told: it waits for the overdue repair.
                recorded = unarmed = True
                return read_back()
            except StoreError as exc:
                # May have committed: creating it again is the documented retry, and a run in
                # between runs again (window 3). The verdict is told.
                ambiguous = ambiguous or exc.maybe_applied
                raise

        dues, _ = self._retrying(f"create ({via})", create)
        now = _now_ms()
        for (i, req), due in zip(batch, dues, strict=True):
            line = {"op": "create", "t_ms": now, "i": i, "due_ms": int(due), "kind": kind(i)}
            flags = {"ambiguous": True} if ambiguous else {}
            if unarmed:
                flags["unarmed"] = True
            self.out.write({**line, "via": via, **flags})
            self._recent.append(_Recent(i, int(due), req.tag))
            if req.tag is not None:
                self._tags.setdefault(req.tag, []).append(i)
                self._tag_due_ms[req.tag] = min(self._tag_due_ms.get(req.tag, due), int(due))
        self.created += len(batch)

    def _pick(self) -> _Recent | None:
        now = _now_ms()
        for _ in range(5):
            if not self._recent:
                return None
            t = self._recent[self.rng.randrange(len(self._recent))]
            if t.tag is None and t.due_ms - now >= self.MARGIN_MS:
                return t
        return None

    def _reschedule(self) -> None:
        t = self._pick()
        if t is None:
            return
        ttl_ms = self.MARGIN_MS + int(self._due_s() * 1000)
        key = self.ke.key_for(Soak.run, t.i)
        old_due_ms = t.due_ms
        applied_ms = 0  # when the call that set the new due began
        recorded = ambiguous = False

        def reschedule() -> int:
            nonlocal applied_ms, recorded, ambiguous
            if not recorded:
                applied_ms = _now_ms()
                try:
                    return int(self.ke.create(Soak.run, t.i, ttl_ms=ttl_ms).due_at_ms)
                except RedisUnavailableError:
                    # Recorded, its key not set (reconciliation arms it): creating it again
                    # would re-create a task that may have run by then (seen in CI during a
                    # Cluster failover: the retry ran it a second time). Read the due back.
                    recorded = True
                except StoreError as exc:
                    ambiguous = ambiguous or exc.maybe_applied
                    raise
                except Exception:
                    ambiguous = True  # applied or not: unknown
                    raise
            return int(self.ke.store.get_many([key])[key].due_at_ms)

        due_ms, failed = self._retrying("reschedule", reschedule)
        # Retries that outlast the old due let the task run at it, and the reschedule that then
        # succeeds creates it again: two runs, both asked for (GUARANTEES window 3).
        ambiguous = ambiguous or (failed > 0 and _now_ms() >= old_due_ms)
        t.due_ms = due_ms
        line = {"op": "reschedule", "t_ms": applied_ms, "i": t.i, "due_ms": due_ms}
        self.out.write({**line, **({"ambiguous": True} if ambiguous else {})})

    def _cancel(self) -> None:
        t = self._pick()
        if t is None:
            return
        t_ms = _now_ms()
        ok, failed = self._retrying("cancel", lambda: self.ke.cancel(Soak.run, t.i))
        t.due_ms = 0  # never picked again
        if failed:
            # An earlier call may have cancelled it with its answer lost: say so.
            self.out.write({"op": "cancel_tag", "t_ms": t_ms, "ids": [t.i], "cancelled": -1})
        else:
            self.out.write({"op": "cancel", "t_ms": t_ms, "i": t.i, "ok": bool(ok)})

    def _cancel_tag(self) -> None:
        now = _now_ms()
        ready = [g for g, due in self._tag_due_ms.items() if due - now >= self.MARGIN_MS]
        if not ready:
            return
        tag = self.rng.choice(ready)
        ids = self._tags.pop(tag)
        del self._tag_due_ms[tag]
        cancelled, _ = self._retrying("cancel_tag", lambda: self.ke.cancel_tag(tag))
        self.out.write({"op": "cancel_tag", "t_ms": now, "ids": ids, "cancelled": cancelled})
        for t in self._recent:
            if t.tag == tag:
                t.due_ms = 0

    def forget_old_tags(self) -> None:
        """Tags all due are no use to `_cancel_tag`: drop them (bounded memory)."""
        now = _now_ms()
        for tag in [g for g, due in self._tag_due_ms.items() if due - now < self.MARGIN_MS]:
            del self._tag_due_ms[tag]
            self._tags.pop(tag, None)


class SoakRun:
    """One run: servers, fleet, producer, faults and sampler, then the verdict."""

    def __init__(self, cfg: SoakConfig, run_dir: Path, say: Callable[[str], None]) -> None:
        self.cfg, self.run_dir, self.say = cfg, run_dir, say
        run_dir.mkdir(parents=True, exist_ok=True)
        work = run_dir / "servers"
        binary = redis_server_binary()
        self.redis = soak_redis(cfg.redis, work, binary)
        self.ledger: MariaDBServer | PostgresServer | PatroniCluster
        if cfg.ledger.startswith("patroni"):
            synchronous = cfg.ledger == "patroni-sync"
            self.ledger = PatroniCluster(work / "patroni", synchronous=synchronous)
        elif cfg.ledger == "postgres":
            self.ledger = PostgresServer(work / "postgres")
        else:
            # A redo log the size of a production one (MariaDB's default is 96 MB): with the
            # test servers' 16 MB, 500 tasks/s fill it in seconds and InnoDB flushes pages
            # under pressure. The Sentinel hour alternated the two on a running server:
            # lateness outside faults p99 21 ms with 16 MB, 15 ms with 256 MB.
            self.ledger = MariaDBServer(work / "mariadb", args=["--innodb-log-file-size=256M"])
        self.faults = _Lines(run_dir / "faults.jsonl")
        self.samples = _Lines(run_dir / "samples.jsonl")
        self.stop = threading.Event()
        self.flushed = False
        self.fault_log: list[dict[str, Any]] = []
        self._hit_ms: int | None = None
        """When the fault being made sent its signal (kill -9, SIGSTOP): its history's `hit_ms`."""
        self.fleet: Fleet | None = None
        self.netns = NetNamespace(work / "netns") if cfg.network else None

    # -- servers ------------------------------------------------------------------------

    @contextlib.contextmanager
    def servers(self) -> Iterator[tuple[list[str], list[str]]]:
        """The Redis (`soak_redis`) and the ledger; yields the listeners' Redis URLs and ledger
        URLs (listener i takes the i-th, or the last; the producer the last)."""
        self.redis.start()
        try:
            if self.netns is not None:
                self.netns.start()
            self.ledger.start()
            db_url = self.ledger.create_database("soak")
            db_urls = [db_url]
            if isinstance(self.ledger, PatroniCluster):
                # As teams run it: most listeners name every node (libpq picks the one taking
                # writes), one goes through HAProxy and Patroni's health check.
                db_urls = [self.ledger.proxy_url("soak"), db_url]
            yield self.redis.listener_urls(self.cfg.listeners), db_urls
        finally:
            netns_stop = self.netns.stop if self.netns else (lambda: None)
            for stop in (netns_stop, self.ledger.stop, self.redis.stop):
                with contextlib.suppress(Exception):
                    stop()

    def _on_primaries(self, command: Callable[[redis.Redis], Any]) -> list[Any]:
        """`command` run on each primary's client (closed after)."""
        out = []
        for client in self.redis.primaries():
            try:
                out.append(command(client))
            finally:
                client.close()
        return out

    def wait_fleet(self, cap_s: float = 60.0) -> bool:
        """Until every listener says it is ready again (False at the cap)."""
        assert self.fleet is not None
        fleet = self.fleet
        try:
            wait_until(fleet.ready, cap_s, interval_s=0.1, message="listeners not all ready")
        except Exception:  # a slow recovery is a finding, not a crash
            return False
        return True

    # -- the run ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run the whole soak; returns the report (also written as `soak.json`)."""
        cfg = self.cfg
        with sigterm_as_interrupt(), self.servers() as (urls, db_urls):
            fleet = self.fleet = Fleet(self.run_dir, db_urls, urls, cfg, self.netns)
            settings = Settings(
                redis_url=self.redis.url(), database_url=db_urls[-1], sentinel_count=0
            )
            ke = Client(settings)
            try:
                fleet.start()
                if not self.wait_fleet(90):
                    raise RuntimeError("the listeners never all became ready")
                return self._measure(fleet, ke)
            finally:
                self.stop.set()
                fleet.stop()
                ke.close()
                self.faults.close()
                self.samples.close()

    def _measure(self, fleet: Fleet, ke: Client) -> dict[str, Any]:
        cfg = self.cfg
        produce_s = cfg.minutes * 60
        start_ms, t0 = _now_ms(), time.monotonic()
        produced = _Lines(self.run_dir / "produced.jsonl")
        producer = Producer(ke, cfg, produced, t0 + produce_s, random.Random(cfg.seed))
        threads = [
            threading.Thread(target=producer.run, args=(self.stop,), name="producer"),
            threading.Thread(target=self._sample_loop, args=(fleet, ke), name="sampler"),
            threading.Thread(target=self._fault_loop, args=(fleet, t0, produce_s), name="faults"),
        ]
        for t in threads:
            t.start()
        self.say(
            f"soak: {cfg.minutes:g} min of {cfg.rate_per_s} tasks/s, a fault every "
            f"{cfg.fault_every_s:g} s, output in {self.run_dir}"
        )
        while time.monotonic() < t0 + produce_s and not self.stop.is_set():
            time.sleep(min(10.0, max(0.0, t0 + produce_s - time.monotonic())))
            producer.forget_old_tags()
            self.say(
                f"  {int(time.monotonic() - t0)} s: {producer.created} created, "
                f"{producer.errors} producer errors"
            )
        threads[0].join()
        threads[2].join()
        produce_end_ms = _now_ms()
        drained = self._drain(ke, cap_s=cfg.max_due_s + 120)
        self.stop.set()
        threads[1].join()
        produced.close()
        end_ms = _now_ms()
        params = {
            "start_ms": start_ms,
            "produce_end_ms": produce_end_ms,
            "end_ms": end_ms,
            "warm_up_s": cfg.warm_up_s,
            "max_due_s": cfg.max_due_s,
            "max_attempts": len(RETRY_SCHEDULE_S) + 1,
            "settle_s": cfg.settle_s,
            "growth_limit": 0.10,
            "retain_done_s": cfg.retain_done_s,
            "prune_every_s": cfg.prune_every_s,
            "rate_per_s": cfg.rate_per_s,
            # Asynchronous replication: a primary lost may take its last commits with it
            # (GUARANTEES, PostgreSQL under Patroni); the verdict documents what that explains.
            "lost_commit_faults": ["pg_kill_primary"] if cfg.ledger == "patroni" else [],
            "lost_commit_window_ms": LOST_COMMIT_WINDOW_MS,
        }
        return {
            "config": asdict(cfg),
            "params": params,
            "drained": drained,
            "created": producer.created,
            "producer_errors": producer.errors,
            "faults": self.fault_log,
        }

    def _drain(self, ke: Client, cap_s: float) -> bool:
        """Until no task is pending or running (every due one ran), or `cap_s`."""
        self.say("  draining: waiting for every task still due to run")
        deadline = time.monotonic() + cap_s
        while time.monotonic() < deadline:
            rows = self._rows(ke)
            if rows is not None and rows.get("pending", 0) + rows.get("running", 0) == 0:
                return True
            time.sleep(1.0)
        return False

    # -- sampling -----------------------------------------------------------------------

    def _rows(self, ke: Client) -> dict[str, int] | None:
        try:
            with ke.store.engine.connect() as conn:
                got = conn.execute(
                    sa.text("SELECT status, COUNT(*) FROM time_limit_task GROUP BY status")
                )
                return {str(s): int(n) for s, n in got}
        except sa.exc.SQLAlchemyError:
            return None

    def _ports(self) -> tuple[set[int], set[int]]:
        if isinstance(self.ledger, PatroniCluster):
            return self.redis.ports(), self.ledger.ports
        return self.redis.ports(), {self.ledger.port}

    def _sample_loop(self, fleet: Fleet, ke: Client) -> None:
        while not self.stop.wait(self.cfg.sample_every_s):
            self.samples.write(self._sample(fleet, ke))

    def _driver_pid(self, ke: Client) -> int | None:
        """The pid of the listener holding the driver's lock (its owner is host:pid:nonce); None
        when no one holds it or Redis does not answer."""
        try:
            owner = ke.redis.get(driver_lock_key(ke.settings.key_prefix))
        except redis.RedisError:
            return None
        parts = owner.decode(errors="replace").split(":") if isinstance(owner, bytes) else []
        return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None

    def _sample(self, fleet: Fleet, ke: Client) -> dict[str, Any]:
        redis_ports, ledger_ports = self._ports()
        driver_pid = self._driver_pid(ke)
        listeners = []
        for slot, pid in fleet.pids():
            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    remote = _remote_ports(pid)
                    cpu = p.cpu_times()
                    listeners.append(
                        {
                            "slot": slot.index,
                            "pid": pid,
                            "started_ms": slot.started_ms,
                            "rss_mb": round(p.memory_info().rss / 2**20, 2),
                            "fds": p.num_fds(),
                            "threads": p.num_threads(),
                            "ledger_conns": sum(1 for r in remote if r in ledger_ports),
                            "redis_conns": sum(1 for r in remote if r in redis_ports),
                            "cpu_s": round(cpu.user + cpu.system, 2),
                            # The driving listener keeps a connection per primary more (its
                            # lookups go to every primary at once): the verdict compares like
                            # with like.
                            "drives": None if driver_pid is None else pid == driver_pid,
                        }
                    )
            except (psutil.Error, OSError):
                continue
        used: int | None = None
        try:
            used = sum(self._on_primaries(lambda c: int(c.info("memory")["used_memory"])))
        except redis.RedisError:
            pass
        return {
            "t_ms": _now_ms(),
            "listeners": listeners,
            "redis_used_bytes": used,
            "ledger_rows": self._rows(ke),
        }

    # -- faults -------------------------------------------------------------------------

    def _fault_loop(self, fleet: Fleet, t0: float, produce_s: float) -> None:
        turn = 0
        rotation = list(self.cfg.faults or self.redis.faults)
        if self.cfg.faults is None and isinstance(self.ledger, PatroniCluster):
            i = rotation.index("ledger_restart")
            rotation[i : i + 1] = PATRONI_FAULTS
        if self.cfg.faults is None and self.netns is not None:
            for n, name in enumerate(NET_FAULTS):
                rotation.insert(2 * n + 1, name)
        victims = {"kill9": 0, "sigstop": 1}
        while True:
            at = t0 + (turn + 1) * self.cfg.fault_every_s
            if at >= t0 + produce_s - 5 or self.stop.wait(max(0.0, at - time.monotonic())):
                return
            name = rotation[turn % len(rotation)]
            turn += 1
            if name == "flushall" and self.flushed:
                continue
            start = _now_ms()
            pids: list[int] = []
            self._hit_ms = None
            try:
                detail = self._fault(name, fleet, victims, pids)
            except Exception as exc:  # the run goes on; the report says so
                detail = f"fault failed: {exc!r:.300}"
            end = _now_ms()
            line: dict[str, Any] = {
                "fault": name,
                "start_ms": start,
                "end_ms": end,
                "pids": pids,
                "detail": detail,
            }
            if self._hit_ms is not None:
                line["hit_ms"] = self._hit_ms
            self.faults.write(line)
            self.fault_log.append(line)
            took = (end - start) / 1000
            self.say(f"  fault {name}: {detail} ({took:.1f} s)")

    def _fault(self, name: str, fleet: Fleet, victims: dict[str, int], pids: list[int]) -> str:
        n = self.cfg.listeners
        if name == "kill9":
            slot = victims["kill9"] % n
            victims["kill9"] += 1
            old = fleet.signal(slot, signal.SIGKILL)
            self._hit_ms = _now_ms()
            pids.append(old)
            # The dead process's port refuses at once, but wait for its successor anyway.
            wait_until(
                lambda: dict((s.index, p) for s, p in fleet.pids())[slot] != old,
                30,
                interval_s=0.05,
                message="listener not restarted",
            )
            return f"listener {slot} killed -9 and restarted, {self._ready()}"
        if name == "sigstop":
            slot = victims["sigstop"] % n
            victims["sigstop"] += 1
            pids.append(fleet.signal(slot, signal.SIGSTOP))
            self._hit_ms = _now_ms()
            time.sleep(self.cfg.sigstop_s)  # the fault's own length
            fleet.signal(slot, signal.SIGCONT)
            return f"listener {slot} stopped {self.cfg.sigstop_s:g} s, {self._ready()}"
        if name == "failover":
            victims["failover"] = victims.get("failover", 0) + 1
            return f"{self.redis.failover(victims['failover'] - 1)}, {self._ready()}"
        if name == "reshard":
            victims["reshard"] = victims.get("reshard", 0) + 1
            return f"{self.redis.reshard(victims['reshard'] - 1)}, {self._ready()}"
        if name == "pubsub_kill":
            killed = sum(self._on_primaries(_kill_pubsub))
            return f"{killed} pubsub connections killed, {self._ready()}"
        if isinstance(self.ledger, PatroniCluster) and name in PATRONI_FAULTS:
            patroni = self.ledger
            action = {
                "pg_kill_primary": patroni.kill_primary,
                "pg_switchover": patroni.switchover,
                "etcd_leader_lost": patroni.etcd_leader_lost,
            }[name]
            return f"{action()}, {self._ready()}"
        if name in NET_FAULTS:
            return self._net_fault(name, fleet, pids)
        if name == "ledger_restart":
            assert not isinstance(self.ledger, PatroniCluster)
            self.ledger.restart()
            return f"{ledger_name(self.cfg.ledger)} stopped and started, {self._ready()}"
        if name == "flushall":
            self.flushed = True
            self._on_primaries(lambda c: c.flushall())
            return "FLUSHALL on every primary; " + self._wait_rearmed()
        if name == "stall":
            cut_off = self.redis.stalled_slots(n)
            pids.extend(pid for slot, pid in fleet.pids() if slot.index in cut_off)
            return f"{self.redis.stall(self.cfg.stall_s, n)}, {self._ready()}"
        raise ValueError(f"unknown fault {name}")

    def _net_fault(self, name: str, fleet: Fleet, pids: list[int]) -> str:
        netns = self.netns
        if netns is None:
            raise ValueError(f"{name} needs SoakConfig.network")
        pids.extend(pid for slot, pid in fleet.pids() if slot.netns is netns)
        redis_ports, ledger_ports = self._ports()
        try:
            if name == "net_partition_redis":
                what = netns.cut(redis_ports)
            elif name == "net_partition_ledger":
                what = netns.cut(ledger_ports)
            else:
                what = netns.degrade()
            time.sleep(self.cfg.net_fault_s)  # the fault's own length
        finally:
            netns.heal()
        return f"listener {NET_SLOT} {what} for {self.cfg.net_fault_s:g} s, {self._ready()}"

    def _ready(self) -> str:
        # A fault ends when every listener is ready again: that is when it can run tasks.
        t = time.monotonic()
        ok = self.wait_fleet()
        took = time.monotonic() - t
        return f"all ready {took:.1f} s later" if ok else f"NOT all ready after {took:.0f} s"

    def _wait_rearmed(self, cap_s: float = 120.0) -> str:
        """Until Redis holds a key for at least 90 % of the pending rows again."""
        deadline = time.monotonic() + cap_s
        engine = sa.create_engine(self.ledger.url("soak"))
        try:
            while time.monotonic() < deadline:
                try:
                    with engine.connect() as conn:
                        pending = int(
                            conn.execute(
                                sa.text(
                                    "SELECT COUNT(*) FROM time_limit_task WHERE status='pending'"
                                )
                            ).scalar_one()
                        )
                    keys = sum(self._on_primaries(lambda c: int(c.dbsize())))
                    if keys >= 0.9 * pending:
                        return f"keys re-armed ({keys} keys for {pending} pending rows)"
                except (redis.RedisError, sa.exc.SQLAlchemyError):
                    pass
                time.sleep(0.5)
        finally:
            engine.dispose()
        return f"keys NOT re-armed within {cap_s:g} s"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so a soak stopped by `kill`
    stops its listeners and servers on the way out: a soak killed so left its three listeners
    running (their own process groups), and they ran on through the next hour's soak. Outside
    the main thread (no signal handlers there) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _commit() -> str | None:
    """The commit of the keyexpiry source the run used, when it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _pct(p: dict[str, Any]) -> str:
    if not p.get("count"):
        return "none"
    return f"p50 {p['p50']} / p99 {p['p99']} / max {p['max']} ms of {p['count']}"


def _tails_line(tails: list[dict[str, Any]]) -> str:
    """Issue 42's tail targets in a line: how many were met, and the others with their figure."""
    missed = [
        f"{t['target']} {t['ms']:,} ms (bound {t['bound_ms']:,})" for t in tails if not t["met"]
    ]
    head = f"{len(tails) - len(missed)} of {len(tails)} met"
    return head + (f"; not met: {', '.join(missed)}" if missed else "")


def summary(report: dict[str, Any]) -> str:
    """The verdict in a few lines for the terminal (soak.json holds all of it)."""
    v = report["verdict"]
    fates = ", ".join(f"{name} {f['count']}" for name, f in v["fates"].items() if f["count"])
    late = v["lateness"]
    lines = [
        f"soak verdict: {'PASSED' if v['passed'] else 'FAILED'}",
        f"  created {v['created']} tasks; fates: {fates}; early starts {v['early']['starts']}",
        f"  lateness outside faults: {_pct(late['outside'])}",
        f"  lateness inside faults:  {_pct(late['inside'])}",
    ]
    lines += [f"    {k:<16} {_pct(p)}" for k, p in late["inside_by_fault"].items()]
    if late.get("outside_by_interval"):
        p99s = " ".join(str(b["p99"]) for b in late["outside_by_interval"])
        lines.append(f"  outside p99 per 5 minutes: {p99s}")
    if late.get("unarmed_creates", {}).get("count"):
        lines.append(f"  creates whose key was not set: {_pct(late['unarmed_creates'])}")
    for w in late.get("outside_latest", [])[:3]:
        lines.append(
            f"  latest outside: task {w['i']} {w['late_ms']} ms late ({w['via']} create "
            f"{w['created_after_due_ms']:+d} ms from its due; pid {w['pid']})"
        )
    lines.append(f"  tail targets: {_tails_line(v.get('tails', []))}")
    for f in v["faults"]:
        lines.append(
            f"  fault {f['fault']:<16} {(f['end_ms'] - f['start_ms']) / 1000:5.1f} s  {f['detail']}"
        )
    grown = [
        f"{g.get('slot')}/{g['pid']}" for g in v["growth"]["listeners"] if not g.get("passed", True)
    ]
    lines.append(f"  listener growth: {'none past the limit' if not grown else ', '.join(grown)}")
    servers, bound = v["growth"]["servers"], v["ledger_bound"]
    lines.append(
        "  Redis memory: "
        f"{servers['redis_used_bytes'].get('status')}, pending rows: "
        f"{servers['ledger_pending_rows'].get('status')}, finished rows: "
        f"{bound.get('max_finished_rows')} (bound {bound.get('bound_rows')})"
    )
    tp = v["throughput"]["ok_ends_per_s"]
    lines.append(f"  steady ok ends/s: min {tp['min']} / median {tp['p50']} / max {tp['max']}")
    pace = v.get("pace") or {}
    if pace.get("listener_cores") is not None:
        # The machine's pace: a tail target means little on a machine that spends more CPU on
        # the same work than it did when the target was met.
        lines.append(
            f"  listeners' CPU outside faults: {pace['listener_cores']} cores, "
            f"{pace['listener_cpu_ms_per_start']} ms a start ({pace['quiet_intervals']} samples)"
        )
    lines += [f"  FAILURE: {line}" for line in v["failures"]]
    # A CI log is often all that is left of a failed short soak: the offending tasks' whole
    # history (runs, pids, clocks, window hints) goes with the verdict.
    for name in ("ran_twice_undocumented", "ran_after_cancel", "dead_short", "lost"):
        for example in v["fates"].get(name, {}).get("examples", [])[:3]:
            lines.append(f"  {name}: {json.dumps(example, separators=(',', ':'))[:1500]}")
    return "\n".join(lines)


def _row(name: str, p: dict[str, Any]) -> str:
    cells = [p.get(k) for k in ("count", "p50", "p99", "p99.9", "max")]
    return f"| {name} | " + " | ".join("-" if c is None else f"{c:,}" for c in cells) + " |"


def _growth_rule(verdict: dict[str, Any]) -> str:
    """What *start*, *middle* and *end* are in `verdict`'s growth table (the rule changed)."""
    floors = any(
        str(m.get("basis", "")).startswith("floor")
        for g in verdict["growth"]["listeners"]
        for m in g["metrics"].values()
    )
    medians = (
        "*start*, *middle*, *end*: the medians of the first three samples, of all, and of the "
        "last three"
    )
    if not floors:
        return f"{medians}."
    metrics = [m for g in verdict["growth"]["listeners"] for m in g["metrics"].values()]
    rule = (
        f"RSS: {medians}; the counts (descriptors, threads, connections): the least sample of "
        "the first minute, the middle minute and the last, outside fault windows."
    )
    if any("judged_from_ms" in m for m in metrics):
        rule += (
            " A listener's RSS from when it had met each kind of fault that came after its start."
        )
    if any("judged" in m for m in metrics):
        rule += (
            " Redis connections and descriptors on the samples of one driving state (the driving "
            "listener holds a connection per primary more)."
        )
    return rule


def _middle(check: dict[str, Any]) -> float | None:
    """A growth check's middle value (named `median` in reports before the floor rule)."""
    value = check.get("middle", check.get("median"))
    return None if value is None else float(value)


def markdown(report: dict[str, Any], images: str) -> str:
    """A soak report as the Markdown section docs/RELIABILITY.md shows (`images`: where its
    PNGs are, relative to the document)."""
    v, cfg, m = report["verdict"], report["config"], report["machine"]
    start_ms = int(report["params"]["start_ms"])
    when = dt.datetime.fromtimestamp(start_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    minutes = cfg["minutes"]
    lines = [
        f"## Endurance: {minutes:g} minutes of load with a fault every {cfg['fault_every_s']:g} s",
        "",
        f"`keyexpiry bench --scenario soak --minutes {minutes:g}` (`make soak "
        f"SOAK_MINUTES={minutes:g}`), {when}"
        + (f", commit {report['commit']}" if report.get("commit") else "")
        + f", on {m['cpus']} cores, Redis {m['redis']}, "
        f"{_ledger_version(cfg.get('ledger', 'mariadb'), m)}. "
        f"{_redis_description(cfg.get('redis', 'sentinel'))}, "
        f"{ledger_name(cfg.get('ledger', 'mariadb'))}, three listener processes restarted when "
        "they die, production settings but "
        f"retention {cfg['retain_done_s']:g} s. A producer created {cfg['rate_per_s']} tasks/s due "
        f"{cfg['min_due_s']:g} s to {cfg['max_due_s']:g} s ahead (log-uniform; a tenth tagged, a "
        "tenth created in a transaction), rescheduled and cancelled some, cancelled some tags; "
        "1 % of tasks fail once, 0.5 % always (dead after 3 attempts), 0.5 % outlast their 1 s "
        "timeout once. The verdict below is computed from the history the producer and the "
        "handlers wrote (`keyexpiry/bench/soak_verdict.py`), not from logs.",
        "",
        f"**Verdict: {'passed' if v['passed'] else 'FAILED'}.** {v['created']:,} tasks created.",
        "",
        # What was learnt from the run and changed since: kept with the run it is about.
        *[f"- {note}" for note in report.get("notes", [])],
        *([""] if report.get("notes") else []),
        "| fate | tasks |",
        "|---|---:|",
    ]
    lines += [f"| {name.replace('_', ' ')} | {f['count']:,} |" for name, f in v["fates"].items()]
    lines += [f"| early start (> 5 ms before due) | {v['early']['starts']:,} |", ""]
    if v["failures"]:
        lines += [f"- FAILURE: {f}" for f in v["failures"]] + [""]
    late = v["lateness"]
    lines += [
        "Lateness of each task's first start (ms; *inside*: its wait met a fault's window, "
        f"from the fault's start to {report['params']['settle_s']:g} s after its end):",
        "",
        "| tasks | count | p50 | p99 | p99.9 | max |",
        "|---|---:|---:|---:|---:|---:|",
        _row("outside faults", late["outside"]),
        _row("inside faults", late["inside"]),
    ]
    lines += [_row(f"inside {k}", p) for k, p in late["inside_by_fault"].items()]
    if late.get("unarmed_creates", {}).get("count"):
        lines.append(_row("creates whose key was not set", late["unarmed_creates"]))
    if v.get("tails"):
        lines += [
            "",
            "Issue 42's tail targets (a fault's *max past its length*: its worst instance's "
            "latest first start, less the fault's own length):",
            "",
            "| target | ms | bound (ms) | met |",
            "|---|---:|---:|---|",
        ]
        lines += [
            f"| {t['target']} | {t['ms']:,} | {t['bound_ms']:,} | {'yes' if t['met'] else 'no'} |"
            for t in v["tails"]
        ]
    pace = v.get("pace") or {}
    if pace.get("listener_cores") is not None:
        lines += [
            "",
            f"The machine's pace: outside fault windows the listeners used "
            f"{pace['listener_cores']} cores, {pace['listener_cpu_ms_per_start']} ms of CPU a "
            "handler start (compare runs by it: the same code spends more on a slower machine, "
            "and its tail grows with it).",
        ]
    lines += [
        "",
        "| at (min) | fault | lasted (s) | what happened |",
        "|---:|---|---:|---|",
    ]
    for f in v["faults"]:
        at_min = (f["start_ms"] - start_ms) / 60000
        took_s = (f["end_ms"] - f["start_ms"]) / 1000
        lines.append(f"| {at_min:.1f} | {f['fault']} | {took_s:.1f} | {f['detail']} |")
    lines += [
        "",
        f"Growth after the {cfg['warm_up_s']:g} s warm-up (each listener process from its own "
        f"start plus the warm-up; samples every 10 s). {_growth_rule(v)} The end may exceed "
        "neither the middle nor the start by more than 10 %, and a count also by more than one:",
        "",
        "| slot / pid | samples | RSS MB start → middle → end | fds | threads | ledger conns "
        "| redis conns |",
        "|---|---:|---|---|---|---|---|",
    ]
    for g in v["growth"]["listeners"]:
        cells = []
        for name in ("rss_mb", "fds", "threads", "ledger_conns", "redis_conns"):
            mm = g["metrics"][name]
            middle = _middle(mm)
            cells.append(
                f"{mm['start']:g} → {middle:g} → {mm['end']:g}"
                if middle is not None
                else str(mm["status"])
            )
        lines.append(f"| {g['slot']} / {g['pid']} | {g['samples']} | " + " | ".join(cells) + " |")
    srv, bound = v["growth"]["servers"], v["ledger_bound"]
    for label, key in (
        ("Redis used memory (bytes)", "redis_used_bytes"),
        ("pending rows", "ledger_pending_rows"),
    ):
        mm = srv[key]
        middle = _middle(mm)
        shown = (
            f"{mm['start']:,.0f} → {middle:,.0f} → {mm['end']:,.0f}"
            if middle is not None
            else mm["status"]
        )
        lines.append(f"\n{label}, start → middle (median) → end: {shown} ({mm['status']}).")
    tp = v["throughput"]["ok_ends_per_s"]
    lines += [
        "",
        f"Finished rows (done, dead, cancelled) peaked at {bound.get('max_finished_rows'):,} "
        f"against a bound of {bound.get('bound_rows'):,} (rate x (retention + prune interval) x "
        "1.25, plus the dead). Steady throughput, successful runs per second per 10 s: "
        f"min {tp['min']}, median {tp['p50']}, max {tp['max']}.",
        "",
        f"![lateness]({images}/soak-lateness.png)",
        "",
        f"![throughput]({images}/soak-throughput.png)",
        "",
        f"![listeners]({images}/soak-listeners.png)",
        "",
    ]
    return "\n".join(lines)


def run(
    cfg: SoakConfig, out_dir: Path, *, say: Callable[[str], None] = print, plots: bool = True
) -> dict[str, Any]:
    """Run a soak into `out_dir/<timestamp>/`; write `soak.json` (and PNGs); return the report."""
    from keyexpiry.bench import soak_history, soak_verdict

    skipped = None
    if plots and importlib.util.find_spec("matplotlib") is None:
        # Said before the run, not after it: the verdict does not need the plots.
        skipped = "plots skipped: matplotlib is not installed (pip install 'keyexpiry[bench]')"
        say(skipped)
        plots = False
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = (out_dir / stamp).resolve()
    commit = _commit()  # what the listeners run: read now, not after minutes of work on the tree
    report = SoakRun(cfg, run_dir, say).run()
    if skipped:
        report["plots_skipped"] = skipped
    report["machine"] = machine()
    report["commit"] = commit
    say("  judging the history")
    history = soak_history.load(run_dir)
    report["verdict"] = soak_verdict.verdict_of(history, report["params"])
    if plots:
        from keyexpiry.bench import soak_plots

        paths = soak_plots.plot(run_dir, report["verdict"], history)
        report["plots"] = [str(p) for p in paths]
    (run_dir / "soak.json").write_text(json.dumps(report, indent=2, default=str))
    report["run_dir"] = str(run_dir)
    return report

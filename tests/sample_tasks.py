"""Task classes the tests schedule; they record calls in-process so tests can assert on them."""

from __future__ import annotations

import os
import threading
from collections import Counter
from decimal import Decimal
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, insert, update

from keyexpiry import DoNotRetry, Retry, current, exposed, task

CALLS: Counter[str] = Counter()
"""How many times each key's handler was entered (in this process)."""
CALL_ARGS: dict[str, tuple[object, ...]] = {}
RUN_DUES: dict[str, list[int]] = {}
"""The due time (ms) each run of a key was claimed for, in call order."""
GATES: dict[str, threading.Event] = {}
BROKEN: set[str] = set()
"""Names `Probe.broken` fails for (until a test "fixes" them by removing the name)."""
RETURNS: dict[str, object] = {}
"""What `Probe.returns` returns for a name (default: a small dict)."""
ENTERED: dict[str, threading.Event] = {}
"""Set when a `Ledgered` run named so is inside its handler."""
FAIL_FIRST: set[str] = set()
"""Names whose first `Ledgered.note` raises after its business write."""
THREADS: dict[str, str] = {}
"""The thread each key's `Probe.quick` last ran on."""
STALLS: set[str] = set()
"""Names `Probe.quick` blocks for on their gate (a handler usually fast that hangs once)."""
RAISES: set[str] = set()
"""Names whose next `Probe.quick` raises (once: the name is then removed)."""
RAISED_ON: dict[str, str] = {}
"""The thread each key's `Probe.quick` raised on."""
business = MetaData()
NOTES = Table(
    "biz_note",
    business,
    Column("name", String(64), nullable=False),
    Column("attempt", Integer, nullable=False),
)
"""A business table in the ledger's database, written by the transactional handlers."""
COUNTERS = Table(
    "biz_counter",
    business,
    Column("name", String(64), primary_key=True),
    Column("n", Integer, nullable=False),
)
"""A business row `Ledgered.hang_locked` locks (by updating it) and holds."""
_lock = threading.Lock()
RUNS_FILE_ENV = "KEYEXPIRY_TEST_RUNS_FILE"
"""`Probe.logged` appends each run's key to the file this variable names (in any process)."""


def _note(*args: object) -> None:
    ctx = current()
    with _lock:
        CALLS[ctx.key] += 1
        CALL_ARGS[ctx.key] = args
        RUN_DUES.setdefault(ctx.key, []).append(ctx.due_at_ms)


def reset() -> None:
    """Forget calls and open gates (called by fixtures between tests)."""
    with _lock:
        CALLS.clear()
        CALL_ARGS.clear()
        RUN_DUES.clear()
        for gate in GATES.values():
            gate.set()
        GATES.clear()
        BROKEN.clear()
        RETURNS.clear()
        ENTERED.clear()
        FAIL_FIRST.clear()
        THREADS.clear()
        STALLS.clear()
        RAISES.clear()
        RAISED_ON.clear()


def runs_in(path: str | os.PathLike[str]) -> Counter[str]:
    """How many times `Probe.logged` ran each key, across all processes writing `path`."""
    try:
        with open(path) as fh:
            return Counter(line.rstrip("\n") for line in fh)
    except FileNotFoundError:
        return Counter()


def gate(name: str) -> threading.Event:
    """The event a `Probe.wait` run named `name` blocks on."""
    with _lock:
        return GATES.setdefault(name, threading.Event())


def entered(name: str) -> threading.Event:
    """The event a `Ledgered` run named `name` sets once inside its handler."""
    with _lock:
        return ENTERED.setdefault(name, threading.Event())


@task
class Probe:
    """Handlers with every behaviour the listener must cope with."""

    @exposed
    def record(self, name: str) -> None:
        _note(name)

    @exposed(retry_schedule_s=[0.05])
    def with_payload(self, name: str, payload: Any = None) -> None:
        """Notes (name, payload, current().payload); fails its first attempt when the payload
        says `fail_once` (every attempt must see the same payload), and while `name` is in
        BROKEN."""
        _note(name, payload, current().payload)
        if isinstance(payload, dict) and payload.get("fail_once") and current().attempt == 1:
            raise RuntimeError("first attempt fails")
        if name in BROKEN:
            raise RuntimeError(f"{name} is broken")

    @exposed
    def traced(self, name: str) -> None:
        """Opens a span of its own: it must nest under the run's span."""
        from opentelemetry import trace

        with trace.get_tracer("handler").start_as_current_span("inside the handler"):
            _note(name)

    @exposed
    def logged(self, name: str) -> None:
        _note(name)
        # One O_APPEND write per run: lines from concurrent workers and processes never mix.
        fd = os.open(os.environ[RUNS_FILE_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{current().key}\n".encode())
        finally:
            os.close(fd)

    @exposed
    def typed(self, n: int, price: Decimal, flag: bool, ratio: float, label: str = "x") -> None:
        _note(n, price, flag, ratio, label)

    @exposed(retry_schedule_s=[0.05, 0.05])
    def always_fail(self, name: str) -> None:
        _note(name)
        raise RuntimeError(f"boom {name}")

    @exposed(retry_schedule_s=[0.05, 0.05])
    def fail_once(self, name: str) -> None:
        _note(name)
        if current().attempt == 1:
            raise RuntimeError("first attempt fails")

    @exposed(retry_schedule_s=[0.05])
    def retry_nan(self, name: str) -> None:
        _note(name)
        if current().attempt == 1:
            raise Retry("asks for a delay no schedule allows", delay_s=float("nan"))

    @exposed(retry_schedule_s=[0.05])
    def broken(self, name: str) -> None:
        _note(name)
        if name in BROKEN:
            raise RuntimeError(f"{name} is broken (attempt {current().attempt})")

    @exposed
    def final(self, name: str) -> None:
        _note(name)
        raise DoNotRetry(f"{name} cannot succeed")

    @exposed(timeout_s=0.3, retry_schedule_s=[0.05])
    def hang_first(self, name: str) -> None:
        _note(name)
        if current().attempt == 1:
            gate(name).wait(10)

    @exposed(timeout_s=30)
    def wait(self, name: str) -> None:
        _note(name)
        gate(name).wait(20)

    @exposed(timeout_s=60)
    def stall(self, name: str) -> None:
        """Blocks (up to 120 s) until its gate opens: a handler with a long timeout."""
        _note(name)
        gate(name).wait(120)

    @exposed(timeout_s=3, retry_schedule_s=[0.05])
    def quick(self, name: str) -> None:
        """Returns at once, noting the thread it ran on; while `name` is in STALLS it says so
        (`entered`) and blocks on its gate (up to 20 s) instead; once in RAISES, it raises."""
        _note(name)
        THREADS[current().key] = threading.current_thread().name
        if name in RAISES:
            RAISES.discard(name)
            RAISED_ON[current().key] = threading.current_thread().name
            raise RuntimeError(f"quick {name} raised")
        if name in STALLS:
            entered(name).set()
            gate(name).wait(20)

    @exposed
    def returns(self, name: str) -> object:
        _note(name)
        return RETURNS.get(name, {"name": name, "attempt": current().attempt})

    def not_exposed(self, name: str) -> None:
        raise AssertionError("a key must never reach a method that is not exposed")


def _write_note(name: str) -> int:
    ctx = current()
    ctx.tx.execute(insert(NOTES).values(name=name, attempt=ctx.attempt))
    return ctx.attempt


@task
class Ledgered:
    """Transactional handlers: each writes a `biz_note` row through `current().tx`."""

    @exposed(transactional=True, retry_schedule_s=[0.05, 0.05])
    def note(self, name: str) -> int:
        _note(name)
        attempt = _write_note(name)
        if name in FAIL_FIRST and attempt == 1:
            raise RuntimeError(f"{name} fails after its write")
        return attempt

    @exposed(transactional=True, timeout_s=0.3, retry_schedule_s=[0.05])
    def slow_first(self, name: str) -> int:
        """The first attempt writes, then outlives its timeout until its gate opens."""
        _note(name)
        attempt = _write_note(name)
        if attempt == 1:
            entered(name).set()
            gate(name).wait(10)
        return attempt

    @exposed(transactional=True, timeout_s=30, retry_schedule_s=[0.05])
    def held(self, name: str) -> int:
        """Waits for its gate, then writes (the write comes last: on SQLite a write holds the
        database's lock, and the test changes the task's row while this waits)."""
        _note(name)
        entered(name).set()
        gate(name).wait(20)
        return _write_note(name)

    @exposed(transactional=True, timeout_s=0.3, retry_schedule_s=[0.05])
    def hang_locked(self, name: str) -> int:
        """Counts in `biz_counter`, which locks the row; the first attempt then hangs with the
        lock held until its gate opens."""
        _note(name)
        ctx = current()
        ctx.tx.execute(update(COUNTERS).where(COUNTERS.c.name == name).values(n=COUNTERS.c.n + 1))
        if ctx.attempt == 1:
            entered(name).set()
            gate(name).wait(10)
        return ctx.attempt

    @exposed(transactional=True)
    def commits_itself(self, name: str) -> None:
        _note(name)
        _write_note(name)
        current().tx.commit()

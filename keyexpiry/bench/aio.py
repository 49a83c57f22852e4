"""`bench --scenario aio`: tasks created per second by many coroutines at once, two ways.

- `threads=T`: `keyexpiry.aio.AsyncClient`, the sync `Client` on T threads (what ships);
- `native=DRIVER`: redis.asyncio plus SQLAlchemy's asyncio extension on an async MySQL driver
  (aiomysql, asyncmy), the same single-row upsert and `SET key "" PXAT due`, one round trip each:
  a prototype of the other design, measured only where the driver is installed (MariaDB only);
- `sync`: one `Client` creating one task after another, the baseline.

Each variant also runs a ticker coroutine (every 5 ms) beside the creates; its longest gap is how
long the event loop was blocked (`max_tick_gap_ms`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.engine import make_url

from keyexpiry import Client
from keyexpiry.aio import AsyncClient
from keyexpiry.bench.harness import Servers, median_of, settings_for
from keyexpiry.keys import format_key
from keyexpiry.ledger.rows import NewTask

COROUTINES = 64
"""Coroutines creating at once (a busy web app's concurrent requests)."""
THREADS = (4, 8, 16)
NATIVE_DRIVERS = ("aiomysql", "asyncmy")
_TICK_S = 0.005
_DAY_MS = 86_400_000


def native_drivers(backend: str) -> list[str]:
    """The async MySQL drivers installed (none for SQLite: the prototype is MySQL's upsert;
    none without greenlet, which SQLAlchemy's asyncio extension needs)."""
    if backend != "mariadb" or importlib.util.find_spec("greenlet") is None:
        return []
    return [d for d in NATIVE_DRIVERS if importlib.util.find_spec(d) is not None]


def variants(backend: str) -> list[str]:
    """The variants' names, in the order they run."""
    return ["sync", *(f"threads={t}" for t in THREADS)] + [
        f"native={d}" for d in native_drivers(backend)
    ]


async def _with_ticker(work: Awaitable[None]) -> float:
    """Run `work` with a ticker beside it; return the ticker's longest gap in ms."""
    worst = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(_TICK_S)
            now = time.perf_counter()
            worst = max(worst, now - last - _TICK_S)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        await work
    finally:
        done.set()
        await ticker
    return worst * 1000


async def _fan_out(n: int, one: Callable[[int], Awaitable[None]]) -> None:
    """`one(i)` for i < n, from `COROUTINES` coroutines each taking the next i."""
    numbers = iter(range(n))

    async def worker() -> None:
        for i in numbers:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(COROUTINES)))


async def _threads(urls: tuple[str, str], n: int, threads: int) -> dict[str, Any]:
    async with AsyncClient(settings_for(*urls), threads=threads) as ke:

        async def one(i: int) -> None:
            await ke.create("Bench.other", i, ttl_s=86_400)

        start = time.perf_counter()
        gap_ms = await _with_ticker(_fan_out(n, one))
        took = time.perf_counter() - start
    return {"creates_per_s": round(n / took), "max_tick_gap_ms": round(gap_ms, 1)}


async def _native(urls: tuple[str, str], n: int, driver: str) -> dict[str, Any]:
    import redis.asyncio as aredis
    from sqlalchemy.ext.asyncio import create_async_engine

    from keyexpiry.ledger.store import Store
    from keyexpiry.ledger.upsert import upsert_statement

    redis_url, db_url = urls
    with Client(settings_for(*urls)) as sync:  # the schema, and the task spec
        spec = sync.spec("Bench.other")
    engine = create_async_engine(
        make_url(db_url).set(drivername=f"mysql+{driver}"),
        pool_size=10,
        isolation_level="AUTOCOMMIT",  # one round trip a create, as Client's autocommit path
    )
    r = aredis.Redis.from_url(redis_url)
    upsert = upsert_statement("mysql")
    try:
        seconds, micros = await r.time()
        base_ms, base_s = seconds * 1000 + micros // 1000, time.monotonic()

        async def one(i: int) -> None:
            now_ms = base_ms + int((time.monotonic() - base_s) * 1000)
            encoded = spec.encode_args((i,))
            key = format_key(spec.class_name, spec.method, encoded)
            task = NewTask(key, spec.class_name, spec.method, encoded, now_ms + _DAY_MS, None)
            async with engine.connect() as conn:
                await conn.execute(upsert, Store._bound_row(task, now_ms))
            await r.set(key, b"", pxat=task.due_at_ms)

        start = time.perf_counter()
        gap_ms = await _with_ticker(_fan_out(n, one))
        took = time.perf_counter() - start
    finally:
        await r.aclose()
        await engine.dispose()
    return {"creates_per_s": round(n / took), "max_tick_gap_ms": round(gap_ms, 1)}


def _sync(urls: tuple[str, str], n: int) -> dict[str, Any]:
    with Client(settings_for(*urls)) as client:
        start = time.perf_counter()
        for i in range(n):
            client.create("Bench.other", i, ttl_s=86_400)
        took = time.perf_counter() - start
    return {"creates_per_s": round(n / took)}


def measure(urls: tuple[str, str], variant: str, n: int) -> dict[str, Any]:
    """One run of `variant` on a fresh Redis and ledger: `n` creates."""
    kind, _, value = variant.partition("=")
    if kind == "sync":
        return _sync(urls, n)
    if kind == "threads":
        return asyncio.run(_threads(urls, n, int(value)))
    return asyncio.run(_native(urls, n, value))


def run(
    srv: Servers, backend: str, *, runs: int, size: float, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Each round runs every variant once (the machine's noise moves a round together)."""
    n = int(5000 * size)
    names = variants(backend)
    if backend == "mariadb" and (absent := set(NATIVE_DRIVERS) - set(native_drivers(backend))):
        say(f"  native variants skipped: {', '.join(sorted(absent))} not installed")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(runs):
        for name in names:
            got = measure(srv.fresh(backend), name, n)
            got["n"] = n
            results[name].append(got)
            shown = ", ".join(f"{k}={v}" for k, v in got.items())
            say(f"  {name} run {i + 1}/{runs}: {shown}")
    return {name: {"median": median_of(rs), "runs": rs} for name, rs in results.items()}

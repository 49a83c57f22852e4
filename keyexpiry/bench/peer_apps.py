"""The huey and arq side of the peer benchmark: one trivial handler, its consumer, its scheduler.

Kept apart from `keyexpiry.bench.peers` (and free of the rest of keyexpiry, SQLAlchemy and the
harness) because the consumer processes import it: their RSS should be the library's, not the
benchmark's.

The handler takes `time.time()` first thing and appends `i due_ms start_ms end_ms` to a file;
the benchmark computes the due times with `time.time()` too, so both sides read the same host
clock. Consumers run with each library's default settings.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys
import time
from typing import Any

PEERS = ("huey", "arq")
HUEY_NAME = "keyexpiry-bench"
# Concurrent enqueues for arq: it has no bulk enqueue and one enqueue is ~3 round trips.
ARQ_ENQUEUE_BATCH = 100

_out_fd: int | None = None


def record(i: int, due_ms: int, start_s: float) -> None:
    """Append one line for a run that started at `start_s` (O_APPEND: one write per line)."""
    end_s = time.time()
    assert _out_fd is not None, "record() runs inside a consumer started by serve()"
    os.write(_out_fd, f"{i} {due_ms} {start_s * 1000:.3f} {end_s * 1000:.3f}\n".encode())


def _huey_noop(i: int, due_ms: int) -> None:
    record(i, due_ms, time.time())


async def _arq_noop(ctx: dict[Any, Any], i: int, due_ms: int) -> None:
    record(i, due_ms, time.time())


def huey_app(redis_url: str) -> tuple[Any, Any]:
    """A RedisHuey with the library's defaults and the noop task registered (both sides)."""
    from huey import RedisHuey

    app = RedisHuey(HUEY_NAME, url=redis_url)
    return app, app.task(name="noop")(_huey_noop)


def serve(lib: str, redis_url: str, out: str) -> None:
    """Run `lib`'s consumer in this process until it is signalled, recording to `out`."""
    global _out_fd
    _out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if lib == "huey":
        app, _ = huey_app(redis_url)
        # Consumer defaults = huey_consumer's: 1 worker thread, scheduler every 1 s.
        app.create_consumer().run()
    elif lib == "arq":
        from arq.connections import RedisSettings
        from arq.worker import Worker, func

        # Worker defaults: max_jobs 10, poll_delay 0.5 s; SIGTERM stops it gracefully.
        Worker(
            functions=[func(_arq_noop, name="noop")],
            redis_settings=RedisSettings.from_dsn(redis_url),
        ).run()
    else:
        raise ValueError(f"unknown peer {lib!r}")


def schedule(lib: str, redis_url: str, jobs: list[tuple[int, int]]) -> None:
    """Schedule noop(i, due_ms) at due_ms (epoch ms, host clock) for every (i, due_ms)."""
    if lib == "huey":
        _, noop = huey_app(redis_url)
        for i, due_ms in jobs:
            noop.schedule(args=(i, due_ms), eta=_utc(due_ms))
    elif lib == "arq":
        asyncio.run(_arq_schedule(redis_url, jobs))
    else:
        raise ValueError(f"unknown peer {lib!r}")


async def _arq_schedule(redis_url: str, jobs: list[tuple[int, int]]) -> None:
    from arq.connections import RedisSettings, create_pool

    pool = await create_pool(RedisSettings.from_dsn(redis_url))
    try:
        for base in range(0, len(jobs), ARQ_ENQUEUE_BATCH):
            await asyncio.gather(
                *(
                    pool.enqueue_job("noop", i, due_ms, _defer_until=_utc(due_ms))
                    for i, due_ms in jobs[base : base + ARQ_ENQUEUE_BATCH]
                )
            )
    finally:
        await pool.aclose()


def _utc(epoch_ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_ms / 1000, tz=dt.UTC)


if __name__ == "__main__":
    # python -m keyexpiry.bench.peer_apps <huey|arq> <redis_url> <out file>. Through the
    # imported module: huey names tasks after their module, which must read
    # keyexpiry.bench.peer_apps on both sides.
    from keyexpiry.bench import peer_apps

    peer_apps.serve(*sys.argv[1:4])

"""The peers' side of `bench --scenario run-now`: Celery, Dramatiq, RQ, arq and huey, each with
its Redis broker, one trivial task, its worker, its enqueue calls.

Kept free of the rest of keyexpiry, SQLAlchemy and the harness (as `peer_apps` is) because the
worker processes import it: their CPU and RSS should be the library's, not the benchmark's.

The task is `runnow(i, sent_ms)`: `sent_ms` is the host time (`time.time()`) the producer took
just before its enqueue call; the handler takes `time.time()` first thing and appends
`i sent_ms start_ms end_ms pid` to the record file (one `os.write` of an O_APPEND descriptor per
line, which every worker process and thread of a run shares). `pid` names the worker process
(for RQ's default Worker, the worker, not the work horse it forks for the job).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

PEERS = ("celery", "dramatiq", "rq", "arq", "huey")
VARIANTS = {"rq-simple": "rq"}
"""Settings variants run as systems of their own: name -> the library they need."""
NAME = "keyexpiry-bench-runnow"
WARMUP = -1
"""The tasks that show a worker process is up; not counted."""
WARMUP_S = 0.2
"""How long a warm-up task holds its worker, so that the next one goes to another process."""
ARQ_ENQUEUE_BATCH = 100
"""Concurrent enqueues for arq's bulk: it has no bulk enqueue and one enqueue is ~3 round trips."""
RQ_CHUNK = 10_000

_out_fd: int | None = None


def record(i: int, sent_ms: float, start_s: float, pid: int | None = None) -> None:
    """Append one line for a run that started at `start_s`; a warm-up first holds its worker."""
    if i == WARMUP:
        time.sleep(WARMUP_S)
    _write(i, sent_ms, start_s, pid)


def _write(i: int, sent_ms: float, start_s: float, pid: int | None = None) -> None:
    end_ms = time.time() * 1000
    assert _out_fd is not None, "record() runs inside a worker started by serve()"
    line = f"{i} {sent_ms:.3f} {start_s * 1000:.3f} {end_ms:.3f} {pid or os.getpid()}\n"
    os.write(_out_fd, line.encode())


def _plain_runnow(i: int, sent_ms: float) -> None:
    record(i, sent_ms, time.time())


def rq_runnow(i: int, sent_ms: float) -> None:
    """RQ's task (by import path); under the default Worker this runs in a forked work horse."""
    start_s = time.time()
    record(i, sent_ms, start_s, os.getppid() if _rq_forks else None)


_rq_forks = False


async def _arq_runnow(ctx: dict[Any, Any], i: int, sent_ms: float) -> None:
    start_s = time.time()
    if i == WARMUP:
        await asyncio.sleep(WARMUP_S)  # not record()'s sleep: that would block arq's loop
    _write(i, sent_ms, start_s)


def _celery(redis_url: str) -> tuple[Any, Any]:
    from celery import Celery

    app = Celery(NAME, broker=redis_url)  # no result backend: nothing reads a result
    app.conf.broker_connection_retry_on_startup = True  # the default; set to silence its warning
    return app, app.task(name="runnow")(_plain_runnow)


def _dramatiq(redis_url: str) -> tuple[Any, Any]:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=redis_url)
    dramatiq.set_broker(broker)
    return broker, dramatiq.actor(_plain_runnow, actor_name="runnow", broker=broker)


def _rq_queue(redis_url: str) -> Any:
    from redis import Redis
    from rq import Queue

    return Queue(NAME, connection=Redis.from_url(redis_url))


def _huey(redis_url: str) -> tuple[Any, Any]:
    from huey import RedisHuey

    app = RedisHuey(NAME, url=redis_url)
    return app, app.task(name="runnow")(_plain_runnow)


def _arq_settings(redis_url: str) -> Any:
    from arq.connections import RedisSettings

    return RedisSettings.from_dsn(redis_url)


def serve(lib: str, redis_url: str, out: str, processes: int = 1) -> None:
    """Run `lib`'s worker in this process until SIGTERM, recording to `out`.

    `processes` matters to Celery (prefork pool size) and huey (process workers); the others
    are one process each (the benchmark starts several).
    """
    global _out_fd, _rq_forks
    _out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if lib == "celery":
        import warnings

        # The benchmark runs as root where it runs in a container: Celery warns, once, at start.
        warnings.filterwarnings("ignore", message=".*superuser privileges")
        app, _ = _celery(redis_url)
        # Its start-up banner goes to stdout, which carries nothing else here.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        argv = ["worker", "--pool=prefork", f"--concurrency={processes}", "--loglevel=WARNING"]
        app.worker_main(argv)
    elif lib == "dramatiq":
        import dramatiq

        broker, _ = _dramatiq(redis_url)
        worker = dramatiq.Worker(broker)  # worker_threads=8, as the CLI's --threads default
        worker.start()
        _wait_for_sigterm()
        worker.stop()
    elif lib in ("rq", "rq-simple"):
        from rq import SimpleWorker, Worker

        queue = _rq_queue(redis_url)
        _rq_forks = lib == "rq"
        cls = Worker if lib == "rq" else SimpleWorker
        cls([queue], connection=queue.connection).work(logging_level="WARNING")
    elif lib == "arq":
        from arq.worker import Worker as ArqWorker
        from arq.worker import func

        # Defaults: max_jobs 10, poll_delay 0.5 s; SIGTERM stops it gracefully.
        ArqWorker(
            functions=[func(_arq_runnow, name="runnow")],
            redis_settings=_arq_settings(redis_url),
        ).run()
    elif lib == "huey":
        app, _ = _huey(redis_url)
        kind = "process" if processes > 1 else "thread"
        app.create_consumer(workers=processes, worker_type=kind).run()
    else:
        raise ValueError(f"unknown peer {lib!r}")


def _wait_for_sigterm() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


class Sender(Protocol):
    """A producer of `runnow` tasks on one peer."""

    def send(self, i: int, sent_ms: float) -> None:
        """Enqueue one task."""

    def send_many(self, items: list[tuple[int, float]]) -> None:
        """Enqueue many, with the library's bulk call where it has one."""

    def close(self) -> None:
        """Release the connections."""


class _Loop:
    """send() and close() over a send_one callable."""

    def __init__(self, send_one: Callable[[int, float], Any]) -> None:
        self._send_one = send_one

    def send(self, i: int, sent_ms: float) -> None:
        self._send_one(i, sent_ms)

    def send_many(self, items: list[tuple[int, float]]) -> None:
        for i, sent_ms in items:
            self._send_one(i, sent_ms)

    def close(self) -> None:
        pass


class _Celery(_Loop):
    def __init__(self, redis_url: str) -> None:
        self.app, self.task = _celery(redis_url)
        super().__init__(lambda i, sent_ms: self.task.apply_async((i, sent_ms)))

    def send_many(self, items: list[tuple[int, float]]) -> None:
        # Celery has no bulk publish (a group is a loop of apply_async); one held producer.
        with self.app.producer_or_acquire() as producer:
            for i, sent_ms in items:
                self.task.apply_async((i, sent_ms), producer=producer)

    def close(self) -> None:
        self.app.close()


class _Rq(_Loop):
    def __init__(self, redis_url: str) -> None:
        self.queue = _rq_queue(redis_url)
        super().__init__(lambda i, sent_ms: self.queue.enqueue(rq_runnow, i, sent_ms))

    def send_many(self, items: list[tuple[int, float]]) -> None:
        from rq import Queue

        for base in range(0, len(items), RQ_CHUNK):
            with self.queue.connection.pipeline() as pipe:
                self.queue.enqueue_many(
                    [Queue.prepare_data(rq_runnow, a) for a in items[base : base + RQ_CHUNK]],
                    pipeline=pipe,
                )
                pipe.execute()

    def close(self) -> None:
        self.queue.connection.close()


class _Arq:
    def __init__(self, redis_url: str) -> None:
        from arq.connections import create_pool

        self.loop = asyncio.new_event_loop()
        self.pool = self.loop.run_until_complete(create_pool(_arq_settings(redis_url)))

    def send(self, i: int, sent_ms: float) -> None:
        self.loop.run_until_complete(self.pool.enqueue_job("runnow", i, sent_ms))

    def send_many(self, items: list[tuple[int, float]]) -> None:
        async def gather() -> None:
            for base in range(0, len(items), ARQ_ENQUEUE_BATCH):
                batch = items[base : base + ARQ_ENQUEUE_BATCH]
                await asyncio.gather(*(self.pool.enqueue_job("runnow", *a) for a in batch))

        self.loop.run_until_complete(gather())

    def close(self) -> None:
        self.loop.run_until_complete(self.pool.aclose())
        self.loop.close()


def sender(lib: str, redis_url: str) -> Sender:
    """A producer for `lib` (or a variant of it) on `redis_url`."""
    if lib == "celery":
        return _Celery(redis_url)
    if lib == "dramatiq":
        _, actor = _dramatiq(redis_url)
        return _Loop(lambda i, sent_ms: actor.send(i, sent_ms))
    if lib in ("rq", "rq-simple"):
        return _Rq(redis_url)
    if lib == "arq":
        return _Arq(redis_url)
    if lib == "huey":
        _, task = _huey(redis_url)
        return _Loop(task)
    raise ValueError(f"unknown peer {lib!r}")


if __name__ == "__main__":
    # python -m keyexpiry.bench.peer_runnow <lib> <redis_url> <out file> <processes>. Through
    # the imported module: the handlers' record file is that module's global, and huey and RQ
    # name tasks after their module.
    from keyexpiry.bench import peer_runnow

    lib, redis_url, out, processes = sys.argv[1:5]
    peer_runnow.serve(lib, redis_url, out, processes=int(processes))

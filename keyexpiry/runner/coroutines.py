"""`async def` handlers: run on one event loop of the listener's own, a thread of its own.

A coroutine run goes through the same steps as a thread run (`Executor.begin`, `settle`,
`finish`): the same lease check, timeout, retries and outcome. Those steps touch the ledger and
Redis with blocking clients, so they run on a small thread pool beside the loop; the loop itself
only awaits handlers.

How many coroutines run at once is `Settings.async_concurrency` (not `concurrency`, the worker
threads): a coroutine waiting on I/O costs a few kilobytes, not a thread, so many at once is the
point; the bound keeps a burst of due tasks from claiming faster than the loop can start them
(each claim's lease runs from its claim). Runs past the bound wait, in claim order, counted in
the claimer's window like runs queued for a worker.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from loguru import logger

from keyexpiry import threads
from keyexpiry.context import TaskContext, set_current
from keyexpiry.ledger.rows import Outcome
from keyexpiry.runner.inflight import ClaimedRun, InFlight


class Executor(Protocol):
    """What the event loop needs of the worker pool (`executor.Executor`): the same steps a
    thread run goes through."""

    @property
    def inflight(self) -> InFlight: ...
    @property
    def stopped(self) -> threading.Event: ...
    @property
    def errors(self) -> threads.ThreadErrors: ...
    def begin(self, run: ClaimedRun) -> tuple[Callable[[], Any], TaskContext] | None: ...
    def settle(self, run: ClaimedRun, result: object, error: BaseException | None) -> Outcome: ...
    def finish(self, run: ClaimedRun, outcome: Outcome) -> bool: ...
    def run_broke(self, run: ClaimedRun, exc: Exception) -> None: ...


_CLOSE_WAIT_S = 1.0
"""How long coroutines cancelled at shutdown may take to end."""
_IO_THREADS = 4
"""Threads for the blocking steps around coroutines (lease extension, outcome): each is short."""


class CoroutineRunner:
    """The event loop async handlers run on, started with the first one; at most `limit`
    coroutines at once, later runs wait in claim order."""

    def __init__(self, executor: Executor, limit: int) -> None:
        self._executor = executor
        self._limit = limit
        self._lock = threading.Lock()
        self._futures: dict[ClaimedRun, Future[None]] = {}
        """Runs holding a slot: their coroutine is scheduled or running."""
        self._waiting: collections.deque[ClaimedRun] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._io: ThreadPoolExecutor | None = None
        self._closed = False

    # --- from the worker threads and the watchdog ---------------------------------------------
    def submit(self, run: ClaimedRun) -> None:
        """Schedule `run`'s coroutine, or queue it until a slot is free; never waits."""
        with self._lock:
            if self._closed:
                # A worker took it just as the listener stopped: its lease decides.
                self._executor.inflight.dropped(run)
                return
            if len(self._futures) >= self._limit:
                self._waiting.append(run)
                return
            self._schedule(run)

    def cancel(self, run: ClaimedRun) -> None:
        """Cancel `run`'s coroutine (the watchdog: it ran past its timeout) and give its slot to
        the next run. The coroutine sees CancelledError at its current `await`; one that
        swallows it runs on outside the bound, its outcome discarded."""
        with self._lock:
            future = self._futures.pop(run, None)
            self._fill_slots()
        if future is not None:
            future.cancel()  # thread-safe: cancels the task on the loop

    def withdraw(self) -> list[ClaimedRun]:
        """Take the runs still waiting for a slot (the listener stops: they are released)."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        return waiting

    def close(self) -> None:
        """Cancel the coroutines still running (their leases expire and reconciliation runs them
        again, as for a hung thread at shutdown) and stop the loop."""
        with self._lock:
            loop, thread, io = self._loop, self._thread, self._io
            self._futures.clear()
            self._waiting.clear()
            self._loop = self._thread = self._io = None
            self._closed = True
        if loop is None:
            return
        try:
            # Each sees CancelledError at its `await` and may clean up, for a moment at most.
            asyncio.run_coroutine_threadsafe(_cancel_all(_CLOSE_WAIT_S), loop).result(
                _CLOSE_WAIT_S + 1
            )
        except Exception:
            logger.warning("async handlers did not end when cancelled; the loop stops anyway")
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)
        if not loop.is_running():
            loop.close()
        if io is not None:
            io.shutdown(wait=False, cancel_futures=True)

    # --- internals ----------------------------------------------------------------------------
    def _schedule(self, run: ClaimedRun) -> None:
        # Under the lock: the watchdog's `cancel` finds the future of every run that started.
        loop = self._started_loop()
        self._futures[run] = asyncio.run_coroutine_threadsafe(self._run(run), loop)

    def _fill_slots(self) -> None:
        while self._waiting and len(self._futures) < self._limit:
            self._schedule(self._waiting.popleft())

    def _release(self, run: ClaimedRun) -> None:
        with self._lock:
            self._futures.pop(run, None)
            self._fill_slots()

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            loop.set_exception_handler(_log_loop_error)
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            executor = self._executor
            self._thread = threads.spawn(
                "aio", serve, stopped=executor.stopped, errors=executor.errors
            )
            ready.wait(5)
            self._io = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="keyexpiry-aio-io")
            self._loop = loop
        return self._loop

    async def _run(self, run: ClaimedRun) -> None:
        """One coroutine run: begin (off the loop), await the handler, settle (off the loop)."""
        loop = asyncio.get_running_loop()
        io = self._io
        executor = self._executor
        try:
            prepared = await loop.run_in_executor(io, executor.begin, run)
            if prepared is None:
                return
            call, ctx = prepared
            result, error = await _await_handler(call, ctx)
            await loop.run_in_executor(io, _settle_and_finish, executor, run, result, error)
        # CancelledError (the watchdog, whose timeout outcome is queued, or the listener's stop,
        # where the lease decides) passes through: nothing to record here.
        except Exception as exc:
            await loop.run_in_executor(io, executor.run_broke, run, exc)
        finally:
            self._release(run)


async def _await_handler(
    call: Callable[[], Any], ctx: TaskContext
) -> tuple[object, BaseException | None]:
    """Await the handler in `ctx` (this task's own contextvars: `current()` works in it and in
    whatever it awaits); its result, or the exception it raised."""
    set_current(ctx)
    try:
        with logger.contextualize(key=ctx.key, attempt=ctx.attempt):
            return await call(), None
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # cancelled from outside: the watchdog, or the listener stopping
        return None, exc  # raised by the handler itself: a failure like any other
    except Exception as exc:
        return None, exc
    finally:
        set_current(None)


async def _cancel_all(wait_s: float) -> None:
    """Cancel every task on this loop but this one, and wait up to `wait_s` for them to end."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=wait_s)


def _settle_and_finish(
    executor: Executor, run: ClaimedRun, result: object, error: BaseException | None
) -> None:
    executor.finish(run, executor.settle(run, result, error))


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Errors asyncio reports on the handlers' loop (a task a handler spawned and forgot)."""
    exc = context.get("exception")
    logger.opt(exception=exc).error("event loop of async handlers: {}", context.get("message"))

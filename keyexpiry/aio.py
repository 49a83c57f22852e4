"""`AsyncClient`: the `Client` for asyncio code (FastAPI, aiohttp), never blocking the event loop.

Each call runs the sync `Client` on a small thread pool of its own, so the create path (argument
checks, the upsert, arming, the embedded defaults) is the one `Client` has, not a second copy on
async drivers. `keyexpiry bench --scenario aio` measured this against redis.asyncio with
SQLAlchemy's asyncio extension on aiomysql and asyncmy: the threads created as many tasks per
second or more (docs/ASYNC.md has the figures).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

from keyexpiry.client import Client
from keyexpiry.creates import Target
from keyexpiry.errors import ConfigError
from keyexpiry.registry import Registry, TaskSpec
from keyexpiry.settings import Settings

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_THREADS = 4
"""Threads per `AsyncClient`: the fastest of 4, 8 and 16 in `bench --scenario aio` on MariaDB (2
cores), and the shortest loop gaps (the loop's thread shares the GIL with them). A ledger across
a network, where each call waits longer, may gain from more (`threads=`)."""


def _in_thread(
    method: Callable[Concatenate[Client, P], R],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]:
    """`Client.method` as a coroutine method run on the client's threads: same arguments (a
    keyword `Client` gains later is there too), same result, same exceptions."""

    @functools.wraps(method)
    async def call(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(lambda client: method(client, *args, **kwargs))

    return call


class AsyncClient:
    """Business code's handle on keyexpiry in asyncio code; `Client`'s methods, awaited.

    >>> async with AsyncClient(Settings.from_env()) as ke:
    ...     await ke.create(OrderTimeout.close_unpaid, 218, ttl_s=900)
    'OrderTimeout@close_unpaid@218'

    Nothing connects in the constructor: the first call (or `async with`) opens the `Client` on
    one of the client's threads. `threads` bounds how many calls reach the servers at once; more
    callers wait their turn without blocking the loop. Pass `client=` to share a `Client` you
    made (it is then yours to close).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        registry: Registry | None = None,
        client: Client | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
            raise ConfigError(f"threads must be a whole number from 1 to 256, got {threads!r}")
        self._settings = settings
        self._registry = registry
        self._client = client
        self._owns_client = client is None
        self._open_lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="keyexpiry-aio-client")

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> AsyncClient:
        """Connect now (otherwise the first call does): errors in settings, Redis or the ledger
        surface here. Returns the client."""
        await self._run(lambda client: None)
        return self

    async def aclose(self) -> None:
        """Wait for calls in progress, then release the threads and connections."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown)

    async def __aenter__(self) -> AsyncClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def client(self) -> Client:
        """The sync `Client` underneath (connected on first use; blocks: not for the loop)."""
        with self._open_lock:
            if self._client is None:
                if self._closed:
                    raise ConfigError("this AsyncClient is closed")
                self._client = Client(self._settings, registry=self._registry)
            return self._client

    # --- keys (no I/O once open: plain methods) ---------------------------------------------
    def spec(self, target: Target) -> TaskSpec:
        """The registered task method `target` names (`Client.spec`); after `open()`."""
        return self._opened().spec(target)

    def key_for(self, target: Target, *args: object) -> str:
        """The Redis key of `target(*args)` (`Client.key_for`); after `open()`."""
        return self._opened().key_for(target, *args)

    # --- the Client's calls, awaited ----------------------------------------------------------
    create = _in_thread(Client.create)
    create_many = _in_thread(Client.create_many)
    cancel = _in_thread(Client.cancel)
    cancel_keys = _in_thread(Client.cancel_keys)
    get = _in_thread(Client.get)
    list_tasks = _in_thread(Client.list_tasks)
    list = _in_thread(Client.list)
    cancel_tag = _in_thread(Client.cancel_tag)
    retry = _in_thread(Client.retry)
    retry_keys = _in_thread(Client.retry_keys)
    run_now = _in_thread(Client.run_now)
    ttl_ms = _in_thread(Client.ttl_ms)
    ttl_s = _in_thread(Client.ttl_s)
    pause = _in_thread(Client.pause)
    resume = _in_thread(Client.resume)
    paused = _in_thread(Client.paused)
    read_pauses = _in_thread(Client.read_pauses)
    held = _in_thread(Client.held)
    schedule = _in_thread(Client.schedule)
    schedules = _in_thread(Client.schedules)
    get_schedule = _in_thread(Client.get_schedule)
    unschedule = _in_thread(Client.unschedule)
    pause_schedule = _in_thread(Client.pause_schedule)
    resume_schedule = _in_thread(Client.resume_schedule)
    run_schedule_now = _in_thread(Client.run_schedule_now)

    # --- internals ----------------------------------------------------------------------------
    async def _run(self, call: Callable[[Client], R]) -> R:
        if self._closed:
            raise ConfigError("this AsyncClient is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: call(self.client))

    def _opened(self) -> Client:
        if self._client is None:
            raise ConfigError("open the AsyncClient first (await ke.open(), or async with)")
        return self._client

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        with self._open_lock:
            if self._client is not None and self._owns_client:
                self._client.close()


__all__ = ["AsyncClient"]

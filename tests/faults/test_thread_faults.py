"""No listener thread dies silently: an unexpected exception injected into each of them is logged,
counted, and the listener keeps running tasks and recording their outcomes.

The exception is raised once, from inside the thread's own loop (a method it calls every turn),
as a bug or a value that slipped past every check would; everything else is the real listener
on real Redis and both ledgers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from keyexpiry import Client, Listener, Settings
from keyexpiry.bench.servers import wait_until
from tests.ke import Running
from tests.reliability import Verdict

StartListener = Callable[[Settings], Running]
TASKS = 30


def _raise_once(owner: Any, name: str) -> threading.Event:
    """Make `owner.name` raise RuntimeError on its next call only; the event says it did."""
    real = getattr(owner, name)
    fired = threading.Event()

    def broken(*args: Any, **kwargs: Any) -> Any:
        if not fired.is_set():
            fired.set()
            raise RuntimeError(f"injected into {name}")
        return real(*args, **kwargs)

    setattr(owner, name, broken)
    return fired


# thread name -> (object holding the method, method) the thread calls every turn
INJECT: dict[str, Callable[[Listener], tuple[Any, str]]] = {
    "subscriber": lambda li: (li, "handle_key"),
    "claimer": lambda li: (li.dispatcher.claimer, "_claim_batch"),
    "worker": lambda li: (li.dispatcher.executor, "_lease_covers"),
    "watchdog": lambda li: (li.dispatcher.watchdog, "_fail_late_runs"),
    "recorder": lambda li: (li.rt.store, "record"),
    "driver": lambda li: (li.driver, "_step"),
    "reconcile": lambda li: (li, "_self_check"),
}


@pytest.mark.parametrize("thread", list(INJECT))
def test_an_exception_in_any_listener_thread_is_survived(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    verdict: Verdict,
    thread: str,
) -> None:
    listener = start_listener(settings).listener
    owner, method = INJECT[thread](listener)
    fired = _raise_once(owner, method)
    keys = [
        client.create("Probe.record", f"{thread}-{i}", ttl_ms=50 + 10 * i) for i in range(TASKS)
    ]
    wait_until(fired.is_set, 10, message=f"the {thread} thread never called {method}")
    verdict.check(client, keys, timeout_s=30)
    wait_until(
        lambda: listener.thread_errors.by_thread.get(thread, 0) >= 1,
        5,
        message=f"not counted: {listener.thread_errors.by_thread}",
    )
    # Still whole afterwards: a task created now runs and its outcome is recorded.
    later = client.create("Probe.record", f"{thread}-later", ttl_ms=20)
    wait_until(
        lambda: (row := client.store.get(later)) is not None and row.status == "done",
        10,
        message="the listener stopped recording outcomes",
    )
    assert listener.status()["thread_errors"] == listener.thread_errors.count >= 1

"""A listener runs for months: nothing it keeps may grow with the number of tasks it has run.

Walks every container reachable from a listener that has run many tasks (its own objects and
the libraries' it holds: pools, caches, the run metrics) and fails on any that holds about as
many entries as tasks ran. A per-key statistic, a de-duplication set never emptied or a map of
runs never popped fails it; `bench --scenario memory` measures the process's RSS slope.
"""

from __future__ import annotations

import collections
import gc
import itertools
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.runner.inflight import DispatchStats
from tests import sample_tasks
from tests.ke import Running

StartListener = Callable[[Settings], Running]

TASKS = 1000
"""Tasks per wave: a container that gains half this many entries in the second wave grows with
the tasks run (fixed-size tables, bounded caches and pools filled in the first do not)."""

_SKIP = (
    type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType,
    str, bytes, bytearray, tuple, frozenset,
)  # fmt: skip
"""Not followed: classes, modules and functions (their globals reach everything loaded, which is
not the listener's to keep); immutable values (they cannot grow, only be replaced)."""
_SIZED = (dict, list, set, collections.deque)


def container_sizes(root: object) -> dict[str, int]:
    """The size of every container reachable from `root`, by the path that first reaches it.

    Follows instance attributes (and slots) and container items, and for objects without
    either (queues' internals, C types) what the garbage collector sees them hold.
    """
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    todo: list[tuple[object, str]] = [(root, "listener")]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, _SIZED):
            sizes[f"{path} ({type(obj).__name__})"] = len(obj)
            for k, v in _sample(obj, 100):  # a sample is enough to find nested ones
                todo.append((v, f"{path}[{k!r}]"[:300]))
            continue
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            todo.extend((v, f"{path}.{k}") for k, v in _sample(attrs, None))
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                todo.append((getattr(obj, slot), f"{path}.{slot}"))
        if not attrs and not isinstance(obj, int | float | bool | type(None)):
            todo.extend((r, f"{path}->{type(r).__name__}") for r in gc.get_referents(obj))
    return sizes


def _sample(container: Any, n: int | None) -> list[tuple[Any, Any]]:
    """The first `n` (or all) entries of a container the listener's threads may be changing
    meanwhile: a copy that raced a change ("deque mutated during iteration", seen in CI) is
    taken again."""
    for _ in range(1000):
        items = container.items() if isinstance(container, dict) else enumerate(container)
        try:
            return list(itertools.islice(items, n))
        except RuntimeError:
            continue
    raise AssertionError(f"a {type(container).__name__} changed at every one of 1000 copies")


def grown(before: dict[str, int], after: dict[str, int], by: int) -> dict[str, int]:
    """Containers that gained at least `by` entries between two walks."""
    return {
        path: n - before.get(path, 0) for path, n in after.items() if n - before.get(path, 0) >= by
    }


def test_the_walk_finds_a_container_that_grows() -> None:
    """The check below can fail: a per-key counter like the one the recorder once kept, reached
    through a dataclass, a dict and an object without a __dict__."""
    keyed: collections.Counter[str] = collections.Counter()
    holder = types.SimpleNamespace(stats=DispatchStats(), parts={"a": [keyed]}, fixed=[0] * TASKS)
    before = container_sizes(holder)
    for i in range(TASKS):
        keyed[f"k{i}"] += 1
    holder.fixed = [1] * TASKS  # replaced, not grown
    assert grown(before, container_sizes(holder), TASKS // 2) == {
        "listener.parts['a'][0] (Counter)": TASKS
    }


def _run_wave(client: Client, wave: int) -> None:
    done_before = client.store.counts().get(TaskStatus.DONE.value, 0)
    client.create_many(
        TaskRequest(sample_tasks.Probe.record, (f"w{wave}-{i}",), ttl_ms=300) for i in range(TASKS)
    )
    wait_until(
        lambda: client.store.counts().get(TaskStatus.DONE.value, 0) == done_before + TASKS,
        60,
        message=f"wave {wave} never all ran: {client.store.counts()}",
    )


def test_a_listener_keeps_nothing_per_task_it_ran(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    # Tasks late by more than `stuck_after_s` are said once each (a bounded `SaidOnce`): the
    # suite's 0.5 s made a starved machine's whole wave "stuck" and remembered, which is not
    # what this test looks for.
    settings = replace(settings, stuck_after_s=30.0)
    listener = start_listener(settings).listener
    inflight = listener.dispatcher.inflight
    _run_wave(client, 1)  # fills pools, statement caches, fixed tables
    wait_until(inflight.quiet, 10, message="outcomes never all recorded")
    before = container_sizes(listener)
    _run_wave(client, 2)
    wait_until(inflight.quiet, 10, message="outcomes never all recorded")
    assert listener.dispatcher.stats.done == 2 * TASKS
    assert grown(before, container_sizes(listener), TASKS // 2) == {}

"""Django `@task` functions as keyexpiry task methods: only these run from a key or a row.

Each module holding task functions becomes one task class in keyexpiry's registry, named after
the module (`shop.tasks` → `shop__tasks`), with one exposed method per function: a run is the
key `shop__tasks@close_order@<run id>`, the function's arguments travel as the row's payload
(`{"args": [...], "kwargs": {...}}`), and the key, unique per enqueue, is the result id. A key
or row naming anything else names no registered class or method, and is refused like any
unexposed method. The registry learns a function when the backend enqueues it or when a
listener imports the installed apps' `tasks.py` (`discovery.py`).

A function may opt in to being addressed by its arguments instead (`@keyed` under `@task`): its
key is `shop__tasks@close_unpaid@218`, as a keyexpiry task method's, so enqueueing it again with
the same arguments reschedules the one task (`if_exists` decides how), it can carry a tag made of
its arguments (`tag="order:{order_id}"`) and be cancelled by arguments or tag, and a function
without arguments can run on a schedule (`@exposed(cron=…)`). Its arguments are then typed by
their annotations and limited to what a key holds (int, float, bool, str, Decimal, UUID, date).

Retries: none by default (Django's contract: a task that raises is FAILED). A function asks for
keyexpiry's retries, timeout and flow rules with `@exposed(...)` under `@task`:
`@task` `@exposed(retry_schedule_s=[10, 60], timeout_s=30, concurrency=5, rate="10/s")`.

Each run is wrapped in Django's connection hygiene, as a request is: `close_old_connections()`
before and after (so `CONN_MAX_AGE` is honoured and a worker thread keeps no connection past it),
and the `task_started` / `task_finished` signals are sent around it.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keyexpiry.django.keyed import keyed_of
from keyexpiry.errors import ConfigError, DoNotRetry
from keyexpiry.keys import check_name
from keyexpiry.registry import _EXPOSED_ATTR, ExposeOptions, Registry, TaskSpec

if TYPE_CHECKING:
    from keyexpiry.django.compat import Task

_NO_RETRIES = ExposeOptions(retry_schedule_s=())
"""A Django task's default: its first failure is final (FAILED), as Django's contract says."""

_lock = threading.Lock()
_by_path: dict[str, Task[Any, Any]] = {}
"""Task functions known to this process, by `module.function`."""
_registered: dict[int, set[str]] = {}
"""id(registry) → module paths whose class it holds with every known function."""


def class_name_of(module: str) -> str:
    """The task class name of a module's task functions (`shop.tasks` → `shop__tasks`)."""
    name = module.replace(".", "__")
    try:
        return check_name(name, "task module")
    except Exception:
        raise ConfigError(
            f"task module {module!r} cannot name a task class ({name!r}): module names must "
            "start with a letter"
        ) from None


def spec_of(task: Task[Any, Any], registry: Registry) -> TaskSpec:
    """The registered spec that runs `task` (registering its module's class if needed)."""
    func = task.func
    path = f"{func.__module__}.{func.__qualname__}"
    with _lock:
        known = _by_path.get(path)
        if known is None or known.func is not func:
            _by_path[path] = task
            _registered.get(id(registry), set()).discard(func.__module__)
        done = _registered.setdefault(id(registry), set())
        if func.__module__ not in done:
            _register_module(func.__module__, registry)
            done.add(func.__module__)
    return registry.resolve(class_name_of(func.__module__), func.__name__)


def _register_module(module: str, registry: Registry) -> None:
    methods: dict[str, Any] = {}
    for path, task in _by_path.items():
        if task.func.__module__ == module and path == f"{module}.{task.func.__name__}":
            methods[task.func.__name__] = _method(path, task)
    cls = type(class_name_of(module), (), methods)
    cls.__module__ = module
    cls.__qualname__ = class_name_of(module)
    registry.register(cls)


def _method(path: str, task: Task[Any, Any]) -> Callable[..., Any]:
    options = getattr(task.func, _EXPOSED_ATTR, None)
    if options is None:
        options = _NO_RETRIES
    elif options.retry_schedule_s is None:
        options = dataclasses.replace(options, retry_schedule_s=())
    if options.transactional:
        raise ConfigError(f"{path}: transactional=True is for keyexpiry's own task classes")
    if keyed_of(task) is not None:
        method = _keyed_method(path, task)
    else:
        if options.one_at_a_time or options.schedule is not None:
            raise ConfigError(
                f"{path}: one_at_a_time and cron/every_s need the task's arguments in its key: "
                "mark it @keyed"
            )
        method = _run_id_method(path, task)
    method.__name__ = method.__qualname__ = task.func.__name__
    # The options `@exposed` checked where the function was declared, as a method's would be.
    setattr(method, _EXPOSED_ATTR, options)
    return method


def _keyed_method(path: str, task: Task[Any, Any]) -> Callable[..., Any]:
    # The function's own parameters (its context first left out): the registry reads them as
    # it reads a task method's, and the key's arguments arrive typed.
    params = list(inspect.signature(task.func).parameters.values())
    if task.takes_context:
        params = params[1:]
    try:
        hints = typing.get_type_hints(task.func)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot read type annotations: {exc}") from None
    if inspect.iscoroutinefunction(task.func):

        async def run_async(self: object, *args: Any, **kwargs: Any) -> Any:
            return await run_coroutine(path, {"args": list(args), "kwargs": kwargs})

        method: Callable[..., Any] = run_async
    else:

        def run(self: object, *args: Any, **kwargs: Any) -> Any:
            return run_function(path, {"args": list(args), "kwargs": kwargs})

        method = run
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = inspect.Signature([this, *params])  # type: ignore[attr-defined]
    method.__annotations__ = {p.name: hints[p.name] for p in params if p.name in hints}
    return method


def _run_id_method(path: str, task: Task[Any, Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(task.func):

        async def run_async(self: object, run_id: str, payload: Any = None) -> Any:
            return await run_coroutine(path, payload)

        method: Callable[..., Any] = run_async
    else:

        def run(self: object, run_id: str, payload: Any = None) -> Any:
            return run_function(path, payload)

        method = run
    return method


def known(path: str) -> Task[Any, Any] | None:
    """The task function known as `module.function`, or None."""
    with _lock:
        return _by_path.get(path)


def run_function(path: str, payload: Any) -> Any:
    """One run of the task function `path` on a worker thread, in Django's connection hygiene."""
    from django.db import close_old_connections

    from keyexpiry.django.results import finished, started

    close_old_connections()
    try:
        task, args, kwargs, result = _prepare(path, payload)
        started(result)
        try:
            value = task.call(*_context(task, result), *args, **kwargs)
        except BaseException as exc:
            finished(result, exc)
            raise
        return finished(result, None, value)
    finally:
        close_old_connections()


async def run_coroutine(path: str, payload: Any) -> Any:
    """One run of an `async def` task function, on the listener's event loop."""
    from asgiref.sync import sync_to_async
    from django.db import close_old_connections

    from keyexpiry.django.results import finished, started

    await sync_to_async(close_old_connections)()
    try:
        task, args, kwargs, result = _prepare(path, payload)
        started(result)
        try:
            value = await task.acall(*_context(task, result), *args, **kwargs)
        except BaseException as exc:
            finished(result, exc)
            raise
        return finished(result, None, value)
    finally:
        await sync_to_async(close_old_connections)()


def _prepare(path: str, payload: Any) -> tuple[Task[Any, Any], list[Any], dict[str, Any], Any]:
    from keyexpiry.context import current
    from keyexpiry.django.results import running_result

    task = known(path)
    if task is None:
        raise DoNotRetry(f"{path} is not a Django task function known to this listener")
    if not isinstance(payload, dict):
        raise DoNotRetry(f"{path}: the run has no arguments payload")
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise DoNotRetry(f"{path}: the payload's args and kwargs are malformed")
    return task, args, kwargs, running_result(task, current(), args, kwargs)


def _context(task: Task[Any, Any], result: Any) -> list[Any]:
    """What a function that takes Django's `TaskContext` gets first."""
    if not task.takes_context:
        return []
    from keyexpiry.django.compat import TaskContext

    return [TaskContext(task_result=result)]


__all__ = ["class_name_of", "known", "spec_of"]

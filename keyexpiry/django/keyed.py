"""`@keyed`: a Django task function addressed by its arguments (its business key) rather than by
a run id per enqueue (`functions.py` says what changes)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keyexpiry.errors import ConfigError
from keyexpiry.ledger.if_exists import IfExists, Rule

if TYPE_CHECKING:
    from keyexpiry.django.compat import Task

_KEYED_ATTR = "__keyexpiry_keyed__"


@dataclass(frozen=True, slots=True)
class Keyed:
    """How a `@keyed` task function is addressed."""

    if_exists: Rule = "replace"
    """What enqueueing it again does while it is pending (`Client.create`'s rule)."""
    tag: str | None = None
    """A format string over its arguments (`"order:{order_id}"`): the task's tag."""


def keyed(
    func: Callable[..., Any] | None = None,
    /,
    *,
    if_exists: Rule = "replace",
    tag: str | None = None,
) -> Any:
    """Under `@task`: the function is addressed by its arguments (its business key), not by a
    run id per enqueue. Enqueueing it with the same arguments reschedules the pending task
    (`if_exists`: "replace", "keep", "earlier", "later"); `tag` names it for `cancel_tag`.

    >>> @task
    ... @keyed(if_exists="keep", tag="order:{order_id}")
    ... def close_unpaid(order_id: int) -> None: ...
    """
    rules = [rule.value for rule in IfExists]
    if if_exists not in rules:
        raise ConfigError(f"@keyed if_exists must be one of {rules}, got {if_exists!r}")
    options = Keyed(if_exists, tag)

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _KEYED_ATTR, options)
        return f

    return mark(func) if func is not None else mark


def keyed_of(task: Task[Any, Any]) -> Keyed | None:
    """The `@keyed` options of a task function, or None (a run id per enqueue)."""
    found = getattr(task.func, _KEYED_ATTR, None)
    return found if isinstance(found, Keyed) else None


def key_arguments(task: Task[Any, Any], args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """A `@keyed` function's call as the key's arguments, in order (defaults filled in, so a
    call with and without a default names one task), and every argument by name (for the
    tag)."""
    signature = inspect.signature(task.func)
    lead = [None] if task.takes_context else []
    bound = signature.bind(*lead, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    if task.takes_context:
        named.pop(next(iter(signature.parameters)))
    named.pop("payload", None)
    return list(named.values()), named

"""Task functions the tests enqueue through keyexpiry.django.TasksBackend."""

from __future__ import annotations

from typing import Any

from keyexpiry import exposed
from keyexpiry.django.keyed import keyed
from tests.django.compat import task
from tests.django.shop.models import Order


@task
def close_unpaid(order_id: int) -> str:
    """The ORM inside a handler: close the order unless it was paid."""
    closed = Order.objects.filter(id=order_id, status="unpaid").update(status="closed")
    return "closed" if closed else "kept"


@task
def add(a: int, b: int = 0) -> dict[str, Any]:
    return {"sum": a + b}


@task
def boom(message: str) -> None:
    raise ValueError(message)


@task
@exposed(retry_schedule_s=[0.2])
def flaky(message: str) -> None:
    raise RuntimeError(message)


@task(takes_context=True)
def with_context(context: Any, tag: str) -> dict[str, Any]:
    return {"id": context.task_result.id, "attempt": context.attempt, "tag": tag}


@task
async def add_async(a: int, b: int) -> int:
    return a + b


def not_a_task(path: str) -> None:
    """A plain function: no key or row may run it."""
    raise AssertionError("a plain function ran")


@task
@keyed(if_exists="keep", tag="order:{order_id}")
def remind(order_id: int, kind: str = "email") -> str:
    """Addressed by its arguments: one pending reminder per order and kind."""
    return f"{kind}:{order_id}"


@task
@keyed
@exposed(every_s=1)
def heartbeat() -> str:
    """A schedule declared in code by every listener that runs this module."""
    return "beat"

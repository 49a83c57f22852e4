"""The shop's tasks, on Django's task API (`manage.py keyexpiry listen` runs them)."""

from __future__ import annotations

try:
    from django.tasks import task  # Django 6
except ImportError:  # Django 5.2: the backport
    from django_tasks import task

from django.db.models import Count, Sum

from keyexpiry import exposed
from keyexpiry.django.keyed import keyed
from orders.models import Order


@task
@keyed(tag="order:{order_id}")  # one timeout per order: found and cancelled by its arguments
def close_unpaid(order_id: int) -> str:
    """Close the order unless it was paid; idempotent (a task may run again after a crash)."""
    closed = Order.objects.filter(id=order_id, status="unpaid").update(status="closed")
    return "closed" if closed else "kept"


@task
@keyed
@exposed(cron="0 6 * * *", tz="Europe/Berlin")  # every day at 06:00 Berlin time, no beat
def daily_report() -> dict[str, object]:
    """Orders by status, with their total."""
    rows = Order.objects.values("status").annotate(n=Count("id"), total=Sum("amount"))
    return {r["status"]: {"orders": r["n"], "total": str(r["total"])} for r in rows}

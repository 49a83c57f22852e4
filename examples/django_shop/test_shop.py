"""The shop end to end with pytest-django, against keyexpiry itself: a listener on a thread and
the clock moved forward for the tasks (`keyexpiry.django.testing`). `transactional_db`: the
listener's own connections must see what the test commits."""

from __future__ import annotations

import datetime as dt

import pytest
from django.test import Client
from orders.models import Order

from keyexpiry.django import client as keyexpiry
from keyexpiry.django.testing import listener, run_due

pytestmark = pytest.mark.usefixtures("transactional_db")


def place(http: Client, amount: str = "19.90") -> int:
    response = http.post("/orders/", {"amount": amount})
    assert response.status_code == 201
    return int(response.json()["id"])


def order_tasks_run(within: dt.timedelta) -> list[str]:
    """`run_due`'s keys but the daily report's, whose 06:00 (Berlin) may fall in the window,
    depending on when the test runs."""
    return [key for key in run_due(within=within) if key != "orders__tasks@daily_report"]


def test_an_unpaid_order_is_closed_after_15_minutes(client: Client) -> None:
    with listener():
        order_id = place(client)
        assert order_tasks_run(dt.timedelta(minutes=14)) == []  # not yet
        assert Order.objects.get(id=order_id).status == "unpaid"
        [key] = order_tasks_run(dt.timedelta(minutes=15))
        assert key == f"orders__tasks@close_unpaid@{order_id}"
    assert Order.objects.get(id=order_id).status == "closed"
    assert keyexpiry().get("orders__tasks.close_unpaid", order_id).result == "closed"  # type: ignore[union-attr]


def test_paying_cancels_the_timeout_in_the_same_transaction(client: Client) -> None:
    with listener():
        order_id = place(client)
        assert client.post(f"/orders/{order_id}/pay").status_code == 200
        assert order_tasks_run(dt.timedelta(hours=1)) == []  # nothing left to run
    assert Order.objects.get(id=order_id).status == "paid"
    assert keyexpiry().list(tag=f"order:{order_id}")[0].status == "cancelled"


def test_the_daily_report_is_a_schedule_without_a_beat_process(client: Client) -> None:
    place(client, "10.00")
    place(client, "5.50")
    with listener():
        ke = keyexpiry()
        [schedule] = [s for s in ke.schedules() if s.name == "orders__tasks.daily_report"]
        assert schedule.recurrence.cron == "0 6 * * *"
        # A day ahead: the next 06:00 falls in it (and so do both orders' timeouts).
        ran = run_due(within=dt.timedelta(days=1))
        assert "orders__tasks@daily_report" in ran and len(ran) == 3
        report = ke.get("orders__tasks.daily_report")
    # Run beside the timeouts: each order counted once, closed or not yet.
    assert report is not None and report.result.keys() <= {"unpaid", "closed"}
    assert sum(by_status["orders"] for by_status in report.result.values()) == 2

"""The example business tasks in tasks/ do their job, idempotently, on MariaDB."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from decimal import Decimal

import keyexpiry.examples.auctions
import keyexpiry.examples.orders
import keyexpiry.examples.refunds
import keyexpiry.examples.reminders
from keyexpiry.examples import schema
from sqlalchemy import select

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.store import TaskStatus
from tests.ke import Running, wait_status


def test_examples_change_business_data_once_and_tolerate_reruns(
    client: Client, settings: Settings, start_listener: Callable[[Settings], Running]
) -> None:
    engine = client.store.engine
    schema.ensure_demo_schema(engine)
    with engine.begin() as conn:
        schema.seed_demo(conn)
    start_listener(settings)
    at = dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=200)
    keys = client.create_many(
        [
            TaskRequest(keyexpiry.examples.orders.OrderTimeout.close_unpaid, (218,), ttl_ms=50),
            TaskRequest(keyexpiry.examples.orders.OrderTimeout.close_unpaid, (219,), ttl_ms=50),
            TaskRequest(keyexpiry.examples.orders.OrderTimeout.close_unpaid, (999,), ttl_ms=50),
            TaskRequest("ReceiptConfirm.auto_confirm", (219,), ttl_ms=100),
            TaskRequest("AuctionEnd.end", (42,), at=at),
            TaskRequest("AuctionEnd.end", (404,), ttl_ms=50),
            TaskRequest("AfterSaleTimeout.auto_refund", (7, Decimal("19.90")), ttl_ms=100),
        ]
    )
    statuses = [TaskStatus.DONE] * 5 + [TaskStatus.DEAD, TaskStatus.DONE]
    for key, status in zip(keys, statuses, strict=True):
        wait_status(client, key, status)
    # At-least-once: running every task again (as after a crash) changes nothing further.
    client.create_many(
        [
            TaskRequest(k.split("@")[0] + "." + k.split("@")[1], tuple(k.split("@")[2:]), ttl_ms=10)
            for k in keys
        ]
    )
    for key, status in zip(keys, statuses, strict=True):
        wait_status(client, key, status)
    with engine.connect() as conn:
        orders = dict(conn.execute(select(schema.order.c.id, schema.order.c.status)).all())
        confirmed = conn.execute(
            select(schema.order.c.receipt_confirmed).where(schema.order.c.id == 219)
        ).scalar()
        auction = conn.execute(select(schema.auction.c.status)).scalar()
        sale = conn.execute(select(schema.after_sale.c.status, schema.after_sale.c.refunded)).one()
    assert orders == {218: "closed", 219: "paid"}
    assert confirmed == 1 and auction == "ended"
    assert (sale.status, sale.refunded) == ("refunded", Decimal("19.90"))


def test_the_async_example_reminds_an_unpaid_order_once(
    client: Client, settings: Settings, start_listener: Callable[[Settings], Running]
) -> None:
    engine = client.store.engine
    schema.ensure_demo_schema(engine)
    with engine.begin() as conn:
        schema.seed_demo(conn)
    start_listener(settings)
    remind = keyexpiry.examples.reminders.PaymentReminder.remind
    keys = client.create_many([TaskRequest(remind, (order,), ttl_ms=50) for order in (218, 219)])
    for key in keys:
        wait_status(client, key, TaskStatus.DONE)
    client.create(remind, 218, ttl_ms=10)  # a rerun, as after a crash
    wait_status(client, keys[0], TaskStatus.DONE)
    with engine.connect() as conn:
        reminded = conn.execute(select(schema.reminder.c.order_id)).scalars().all()
    assert reminded == [218]  # the paid order 219 was not reminded; 218 once

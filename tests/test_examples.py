"""The example business code (tasks/ and examples/) does its job, idempotently, on MariaDB."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

import keyexpiry.examples.auctions
import keyexpiry.examples.orders
import keyexpiry.examples.refunds
import keyexpiry.examples.reminders
import pytest
from fastapi.testclient import TestClient
from keyexpiry.examples import schema
from sqlalchemy import func, select

from examples.fastapi_orders import app as shop_app
from examples.fastapi_orders import schema as shop_schema
from examples.fastapi_orders.tasks import PaymentWindow
from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.store import TaskStatus
from tests.ke import Running, make_settings, wait_status


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


# --- examples/fastapi_orders: an order and its timeout task in one transaction ------------------


@pytest.fixture
def shop(
    redis_url: str,
    server_db_url: str,
    tmp_path: Path,
    start_listener: Callable[[Settings], Running],
) -> Iterator[tuple[TestClient, Client]]:
    """The shop on MariaDB and on PostgreSQL with a 2 s payment window (the paid order's create
    and payment fit in it even on a stalled machine), a listener running its task, and a client
    to read the ledger."""
    settings = make_settings(redis_url, server_db_url, tmp_path)
    with TestClient(shop_app.create_app(settings, payment_window_s=2.0)) as http:
        http.put("/stock/tea", json={"available": 5}).raise_for_status()
        start_listener(settings)
        ke = Client(settings)
        try:
            yield http, ke
        finally:
            ke.close()


def _order_status(http: TestClient, order_id: int, status: str) -> None:
    wait_until(
        lambda: http.get(f"/orders/{order_id}").json()["status"] == status,
        10,
        message=f"order {order_id} never became {status}",
    )


def test_fastapi_shop_closes_unpaid_orders_and_cancels_paid_ones(
    shop: tuple[TestClient, Client],
) -> None:
    http, ke = shop
    unpaid = http.post("/orders", json={"sku": "tea", "quantity": 2}).json()
    paid = http.post("/orders", json={"sku": "tea", "quantity": 1}).json()
    answer = http.post(f"/orders/{paid['id']}/pay")
    assert answer.status_code == 200 and answer.json()["timeout_cancelled"] is True

    _order_status(http, unpaid["id"], "closed")
    row = wait_status(ke, ke.key_for(PaymentWindow.close_unpaid, unpaid["id"]), TaskStatus.DONE)
    assert row.attempts == 1
    # The paid order's task was cancelled in the payment's transaction: its key is gone, so
    # it never runs (the unpaid one, due at the same time, already has).
    cancelled = ke.get(PaymentWindow.close_unpaid, paid["id"])
    assert cancelled is not None and cancelled.status is TaskStatus.CANCELLED
    assert cancelled.attempts == 0 and ke.ttl_ms(PaymentWindow.close_unpaid, paid["id"]) is None
    assert http.get(f"/orders/{paid['id']}").json()["status"] == "paid"
    # Closing put the unpaid order's 2 back: 5 - 1 paid.
    with ke.store.engine.connect() as conn:
        assert conn.execute(select(shop_schema.stock.c.available)).scalar() == 4
    # Too late to pay a closed order; nothing to pay twice; no such order.
    assert http.post(f"/orders/{unpaid['id']}/pay").status_code == 409
    assert http.post(f"/orders/{paid['id']}/pay").status_code == 409
    assert http.post("/orders/999999/pay").status_code == 404


def test_fastapi_shop_failing_request_leaves_neither_order_nor_task(
    shop: tuple[TestClient, Client],
) -> None:
    http, ke = shop
    # Refused after the order and its task were written in the transaction: both roll back.
    refused = http.post("/orders", json={"sku": "tea", "quantity": 6})
    assert refused.status_code == 409 and "stock" in refused.json()["detail"]
    # Refused before anything is written.
    assert http.post("/orders", json={"sku": "tea", "quantity": 0}).status_code == 422
    with ke.store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(shop_schema.orders)).scalar() == 0
        assert conn.execute(select(shop_schema.stock.c.available)).scalar() == 5
    assert ke.list_tasks() == []
    assert ke.redis.keys("PaymentWindow@*") == []
    # The same request within stock goes through, task and all.
    accepted = http.post("/orders", json={"sku": "tea", "quantity": 5}).json()
    assert ke.get(PaymentWindow.close_unpaid, accepted["id"]) is not None
    _order_status(http, accepted["id"], "closed")


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

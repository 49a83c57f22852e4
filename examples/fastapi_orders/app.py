"""The shop's HTTP API: an order and its timeout task are created in one transaction; paying
cancels the task in the transaction that marks the order paid.

Run it with `uvicorn examples.fastapi_orders.app:app` and a listener with
`keyexpiry listen --tasks examples.fastapi_orders.tasks` (README.md beside this file).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from sqlalchemy import Connection, insert, select, update

from keyexpiry import Client, Settings

from .schema import create_tables, orders, stock
from .tasks import PaymentWindow

PAYMENT_WINDOW_ENV = "SHOP_PAYMENT_WINDOW_S"
"""How long an order may stay unpaid, in seconds (default 900)."""


class NewOrder(BaseModel):
    """What POST /orders takes."""

    sku: str = Field(min_length=1, max_length=64)
    quantity: int = Field(gt=0, le=1000)


class Order(BaseModel):
    """An order as the API shows it."""

    id: int
    sku: str
    quantity: int
    status: str


class Paid(Order):
    """POST /orders/{id}/pay's answer: the order, and whether its timeout task was cancelled
    (False: it was running at that moment and will find the order paid)."""

    timeout_cancelled: bool


class Stock(BaseModel):
    """PUT /stock/{sku}'s body."""

    available: int = Field(ge=0)


def keyexpiry_client(request: Request) -> Client:
    """The app's keyexpiry client, opened at start-up."""
    ke: Client = request.app.state.ke
    return ke


Ke = Annotated[Client, Depends(keyexpiry_client)]


def create_app(
    settings: Settings | None = None, *, payment_window_s: float | None = None
) -> FastAPI:
    """The app on `settings` (default: `KEYEXPIRY_*` from the environment)."""
    window_s = payment_window_s
    if window_s is None:
        window_s = float(os.environ.get(PAYMENT_WINDOW_ENV) or 900)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ke = Client(settings)
        # The shop's tables live in the ledger's database: a task row can only join a
        # transaction on the database it is stored in.
        create_tables(ke.store.engine)
        app.state.ke = ke
        try:
            yield
        finally:
            ke.close()

    app = FastAPI(title="shop", lifespan=lifespan)

    # Plain `def` endpoints: FastAPI runs them on its thread pool, where blocking SQL and
    # Redis calls do not hold up the event loop.
    @app.post("/orders", status_code=201)
    def create_order(body: NewOrder, ke: Ke) -> Order:
        with ke.store.engine.begin() as conn:
            inserted = conn.execute(
                insert(orders).values(
                    sku=body.sku,
                    quantity=body.quantity,
                    status="unpaid",
                    created_at_ms=ke.clock.now_ms(),
                )
            ).inserted_primary_key
            assert inserted is not None  # a single-row INSERT always has one
            order_id = int(inserted[0])
            # In this transaction: the task exists exactly when the order does. Its key is set
            # when the transaction commits; on any error below, neither is left behind.
            ke.create(PaymentWindow.close_unpaid, order_id, ttl_s=window_s, tx=conn)
            reserved = conn.execute(
                update(stock)
                .where(stock.c.sku == body.sku, stock.c.available >= body.quantity)
                .values(available=stock.c.available - body.quantity)
            ).rowcount
            if not reserved:
                raise HTTPException(409, f"not enough {body.sku!r} in stock")
        return Order(id=order_id, sku=body.sku, quantity=body.quantity, status="unpaid")

    @app.post("/orders/{order_id}/pay")
    def pay(order_id: int, ke: Ke) -> Paid:
        with ke.store.engine.begin() as conn:
            paid = conn.execute(
                update(orders)
                .where(orders.c.id == order_id, orders.c.status == "unpaid")
                .values(status="paid")
            ).rowcount
            order = _order(conn, order_id)
            if not paid:
                raise HTTPException(409, f"order {order_id} is {order.status}, not unpaid")
            # Rolled back with the payment if the commit fails; the key goes once it commits.
            cancelled = ke.cancel(PaymentWindow.close_unpaid, order_id, tx=conn)
        return Paid(**order.model_dump(), timeout_cancelled=cancelled)

    @app.get("/orders/{order_id}")
    def get_order(order_id: int, ke: Ke) -> Order:
        with ke.store.engine.connect() as conn:
            return _order(conn, order_id)

    @app.put("/stock/{sku}", status_code=204)
    def set_stock(sku: str, body: Stock, ke: Ke) -> None:
        with ke.store.engine.begin() as conn:
            changed = conn.execute(
                update(stock).where(stock.c.sku == sku).values(available=body.available)
            ).rowcount
            if not changed:
                conn.execute(insert(stock).values(sku=sku, available=body.available))

    return app


def _order(conn: Connection, order_id: int) -> Order:
    row = conn.execute(select(orders).where(orders.c.id == order_id)).first()
    if row is None:
        raise HTTPException(404, f"no order {order_id}")
    return Order(id=row.id, sku=row.sku, quantity=row.quantity, status=row.status)


app = create_app()
"""For `uvicorn examples.fastapi_orders.app:app`: settings from the environment at start-up."""

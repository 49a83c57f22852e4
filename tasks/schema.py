"""The demo business schema the example tasks work on (not part of keyexpiry itself)."""

from __future__ import annotations

import threading

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    Numeric,
    String,
    Table,
    insert,
)

demo = MetaData()

order = Table(
    "demo_order",
    demo,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("status", String(16), nullable=False),  # unpaid, paid, closed
    Column("delivered", Integer, nullable=False, default=0),
    Column("receipt_confirmed", Integer, nullable=False, default=0),
    Column("closed_at_ms", BigInteger, nullable=True),
)

auction = Table(
    "demo_auction",
    demo,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("status", String(16), nullable=False),  # open, ended
    Column("top_bid", Numeric(12, 2), nullable=True),
    Column("winner", String(64), nullable=True),
)

after_sale = Table(
    "demo_after_sale",
    demo,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("order_id", Integer, nullable=False),
    Column("status", String(16), nullable=False),  # open, answered, refunded
    Column("refunded", Numeric(12, 2), nullable=True),
)

reminder = Table(
    "demo_reminder",
    demo,
    Column("order_id", Integer, primary_key=True, autoincrement=False),  # one reminder an order
    Column("sent_at_ms", BigInteger, nullable=False),
)

_ready: set[int] = set()
_lock = threading.Lock()


def ensure_demo_schema(engine: Engine) -> None:
    """Create the demo tables once per engine (idempotent)."""
    with _lock:
        if id(engine) in _ready:
            return
        demo.create_all(engine, checkfirst=True)
        _ready.add(id(engine))


def seed_demo(conn: Connection) -> None:
    """Demo rows: two orders (one unpaid, one paid), an auction with a bid, an open request."""
    conn.execute(
        insert(order),
        [
            {"id": 218, "status": "unpaid", "delivered": 0, "receipt_confirmed": 0},
            {"id": 219, "status": "paid", "delivered": 1, "receipt_confirmed": 0},
        ],
    )
    conn.execute(insert(auction), [{"id": 42, "status": "open", "top_bid": 99.5, "winner": "ada"}])
    conn.execute(insert(after_sale), [{"id": 7, "order_id": 219, "status": "open"}])

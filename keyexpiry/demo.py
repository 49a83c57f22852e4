"""`keyexpiry demo`: a self-contained tour on the embedded default (Redis + SQLite)."""

from __future__ import annotations

import datetime as dt
import importlib
import shutil
import sys
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import typer
from sqlalchemy import select

from keyexpiry.client import Client
from keyexpiry.creates import TaskRequest
from keyexpiry.errors import ConfigError
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.listener.listener import Listener
from keyexpiry.redis.embedded import stop_embedded_redis
from keyexpiry.settings import Settings

DEMO_MODULES = (
    "keyexpiry.examples.orders",
    "keyexpiry.examples.auctions",
    "keyexpiry.examples.refunds",
    "keyexpiry.examples.reminders",
)
"""The repository's tasks/, shipped in the wheel as keyexpiry.examples."""


def run_demo(settings: Settings, *, timeout_s: float = 60.0) -> bool:
    """Create example tasks due in seconds, run a listener until they all ran, print the result."""
    # Imported by name: in the wheel (and an editable install) tasks/ is keyexpiry.examples.
    schema: Any = importlib.import_module("keyexpiry.examples.schema")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    own_dir = settings.state_dir
    temp = Path(tempfile.mkdtemp(prefix="keyexpiry-demo-"))
    settings = settings.replace(state_dir=temp, redis_url=None, database_url=None)
    typer.echo(f"demo state (embedded Redis + SQLite) in {temp} (not {own_dir})")
    client = Client(settings)
    listener: Listener | None = None
    thread: threading.Thread | None = None
    try:
        schema.ensure_demo_schema(client.store.engine)
        with client.store.engine.begin() as conn:
            schema.seed_demo(conn)
        listener = Listener(settings)
        thread = threading.Thread(target=listener.run, name="demo-listener", daemon=True)
        thread.start()
        if not listener.subscribed.wait(15):
            raise ConfigError("the demo listener did not subscribe within 15 s")
        soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
        keys = client.create_many(
            [
                TaskRequest("PaymentReminder.remind", (218,), ttl_ms=500),
                TaskRequest("OrderTimeout.close_unpaid", (218,), ttl_s=1),
                TaskRequest("OrderTimeout.close_unpaid", (219,), ttl_ms=1500),
                TaskRequest("AuctionEnd.end", (42,), at=soon),
                TaskRequest("ReceiptConfirm.auto_confirm", (219,), ttl_ms=2500),
                TaskRequest("AfterSaleTimeout.auto_refund", (7, Decimal("19.90")), ttl_s=3),
                TaskRequest("AuctionEnd.end", (404,), ttl_ms=3500),
            ]
        )
        cancelled = client.create("OrderTimeout.close_unpaid", 220, ttl_s=2)
        client.cancel("OrderTimeout.close_unpaid", 220)
        typer.echo(f"created {len(keys)} tasks due in 0.5-3.5 s, and cancelled {cancelled}:")
        for key in keys:
            typer.echo(f"  {key}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = client.store.get_many(keys)
            if all(r.status in (TaskStatus.DONE, TaskStatus.DEAD) for r in rows.values()):
                break
            time.sleep(0.05)
        rows = client.store.get_many([*keys, cancelled])
        typer.echo("\nkey                                        status     tries  late (ms)")
        ok = True
        for key in [*keys, cancelled]:
            row = rows[key]
            late = "" if row.started_at_ms is None else str(row.started_at_ms - row.due_at_ms)
            typer.echo(f"{key:<42} {row.status:<10} {row.attempts:>5}  {late:>9}")
            if row.status in (TaskStatus.PENDING, TaskStatus.RUNNING):
                ok = False
        with client.store.engine.connect() as conn:
            orders = conn.execute(select(schema.order.c.id, schema.order.c.status)).all()
            sale = conn.execute(select(schema.after_sale.c.status)).scalar()
            auction = conn.execute(select(schema.auction.c.status)).scalar()
            reminded = conn.execute(select(schema.reminder.c.order_id)).scalars().all()
        typer.echo(
            f"\nbusiness data now: orders {dict((i, s) for i, s in orders)}, "
            f"auction 42 {auction}, after-sale 7 {sale}, reminded orders {list(reminded)}"
        )
        typer.echo("AuctionEnd@end@404 is dead on purpose: its handler raises DoNotRetry.")
        return ok
    finally:
        if listener is not None:
            listener.stop()
        if thread is not None:
            thread.join(timeout=30)
        client.close()
        stop_embedded_redis(temp)
        shutil.rmtree(temp, ignore_errors=True)

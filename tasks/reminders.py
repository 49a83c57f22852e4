"""An `async def` task: remind the buyer of an order still unpaid, through an async API.

The listener awaits it on its own event loop, many at once; blocking work (here the ledger's
sync engine) goes to a thread with `asyncio.to_thread`, so the loop keeps serving the others.
"""

from __future__ import annotations

import asyncio

from loguru import logger
from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError

from keyexpiry import current, exposed, task

from .schema import ensure_demo_schema, order, reminder


async def send_reminder(order_id: int) -> None:
    """Stands in for an async HTTP call to a mail or push service (httpx, aiohttp)."""
    await asyncio.sleep(0.05)


def _unpaid(engine: Engine, order_id: int) -> bool:
    ensure_demo_schema(engine)
    with engine.connect() as conn:
        status = conn.execute(select(order.c.status).where(order.c.id == order_id)).scalar()
    return status == "unpaid"


def _reminded(engine: Engine, order_id: int) -> bool:
    with engine.connect() as conn:
        found = conn.execute(select(reminder.c.order_id).where(reminder.c.order_id == order_id))
        return found.first() is not None


def _note_sent(engine: Engine, order_id: int, at_ms: int) -> bool:
    """Record the reminder; False if one was recorded already (a rerun after a crash)."""
    try:
        with engine.begin() as conn:
            conn.execute(reminder.insert().values(order_id=order_id, sent_at_ms=at_ms))
    except IntegrityError:
        return False
    return True


@task
class PaymentReminder:
    """Reminds buyers of unpaid orders before `OrderTimeout.close_unpaid` closes them."""

    @exposed(timeout_s=30)
    async def remind(self, order_id: int) -> None:
        """Send one reminder for order `order_id` if it is still unpaid.

        At least once: the reminder is sent before it is recorded, so a crash in between sends
        it again on the rerun; a rerun after the record sends nothing.
        """
        ctx = current()
        if not await asyncio.to_thread(_unpaid, ctx.engine, order_id):
            logger.info("order {} is not unpaid: no reminder", order_id)
            return
        if await asyncio.to_thread(_reminded, ctx.engine, order_id):
            logger.info("order {} was reminded already", order_id)
            return
        await send_reminder(order_id)
        await asyncio.to_thread(_note_sent, ctx.engine, order_id, ctx.due_at_ms)
        logger.info("order {} is unpaid: buyer reminded", order_id)

"""The order's timeout task: close it if it is still unpaid when its payment window ends."""

from __future__ import annotations

from loguru import logger
from sqlalchemy import select, update

from keyexpiry import current, exposed, task

from .schema import orders, stock


@task
class PaymentWindow:
    """Closes orders nobody paid for in time and puts their items back in stock."""

    @exposed(timeout_s=30)
    def close_unpaid(self, order_id: int) -> None:
        """Close order `order_id` if it is still unpaid; a paid or closed one is left alone.

        Idempotent: only the run whose conditional UPDATE closes the order restocks its items,
        so a second run (after a crash) changes nothing.
        """
        ctx = current()
        with ctx.engine.begin() as conn:
            order = conn.execute(
                select(orders.c.sku, orders.c.quantity).where(orders.c.id == order_id)
            ).first()
            if order is None:
                logger.warning("order {} does not exist; nothing to close", order_id)
                return
            closed = conn.execute(
                update(orders)
                .where(orders.c.id == order_id, orders.c.status == "unpaid")
                .values(status="closed", closed_at_ms=ctx.due_at_ms)
            ).rowcount
            if closed:
                conn.execute(
                    update(stock)
                    .where(stock.c.sku == order.sku)
                    .values(available=stock.c.available + order.quantity)
                )
        logger.info("order {}: {}", order_id, "closed, unpaid" if closed else "left as it is")

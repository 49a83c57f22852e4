"""Order tasks: close an order still unpaid after its payment window; auto-confirm receipt."""

from __future__ import annotations

from loguru import logger
from sqlalchemy import select, update

from keyexpiry import current, exposed, task

from .schema import ensure_demo_schema, order


@task
class OrderTimeout:
    """Closes orders whose payment window ran out."""

    @exposed(timeout_s=30)
    def close_unpaid(self, order_id: int) -> None:
        """Close order `order_id` if it is still unpaid; a paid or unknown order is left alone.

        Idempotent: the conditional UPDATE makes a second run (after a crash) a no-op.
        """
        ctx = current()
        ensure_demo_schema(ctx.engine)
        with ctx.engine.begin() as conn:
            status = conn.execute(select(order.c.status).where(order.c.id == order_id)).scalar()
            if status is None:
                logger.warning("order {} does not exist; nothing to close", order_id)
                return
            closed = conn.execute(
                update(order)
                .where(order.c.id == order_id, order.c.status == "unpaid")
                .values(status="closed", closed_at_ms=ctx.due_at_ms)
            ).rowcount
        if closed:
            logger.info("order {} was still unpaid: closed", order_id)
        else:
            logger.info("order {} is {}: left open", order_id, status)


@task
class ReceiptConfirm:
    """Confirms receipt automatically some days after delivery."""

    @exposed
    def auto_confirm(self, order_id: int) -> None:
        """Mark a delivered order's receipt as confirmed unless the buyer already did."""
        ctx = current()
        ensure_demo_schema(ctx.engine)
        with ctx.engine.begin() as conn:
            changed = conn.execute(
                update(order)
                .where(
                    order.c.id == order_id,
                    order.c.delivered == 1,
                    order.c.receipt_confirmed == 0,
                )
                .values(receipt_confirmed=1)
            ).rowcount
        logger.info(
            "order {}: receipt {}", order_id, "confirmed" if changed else "needed no confirming"
        )

"""After-sales task: refund automatically when the merchant has not answered in time."""

from __future__ import annotations

from decimal import Decimal

from loguru import logger
from sqlalchemy import update

from keyexpiry import current, exposed, task

from .schema import after_sale, ensure_demo_schema


@task
class AfterSaleTimeout:
    """Refunds after-sales requests nobody answered."""

    @exposed
    def auto_refund(self, request_id: int, amount: Decimal) -> None:
        """Refund `amount` on request `request_id` if it is still open (idempotent)."""
        ctx = current()
        ensure_demo_schema(ctx.engine)
        with ctx.engine.begin() as conn:
            changed = conn.execute(
                update(after_sale)
                .where(after_sale.c.id == request_id, after_sale.c.status == "open")
                .values(status="refunded", refunded=amount)
            ).rowcount
        if changed:
            logger.info("request {} unanswered: refunded {}", request_id, amount)
        else:
            logger.info("request {} was answered or refunded already", request_id)

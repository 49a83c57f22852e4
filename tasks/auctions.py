"""Auction task: end an auction at its closing time."""

from __future__ import annotations

from loguru import logger
from sqlalchemy import select, update

from keyexpiry import DoNotRetry, current, exposed, task

from .schema import auction, ensure_demo_schema


@task
class AuctionEnd:
    """Ends auctions; a missing auction is a final error (retrying cannot make it exist)."""

    @exposed(timeout_s=30, retry_schedule_s=[1, 5, 30])
    def end(self, auction_id: int) -> None:
        """Close auction `auction_id` and announce its winner (idempotent)."""
        ctx = current()
        ensure_demo_schema(ctx.engine)
        with ctx.engine.begin() as conn:
            row = conn.execute(select(auction).where(auction.c.id == auction_id)).first()
            if row is None:
                raise DoNotRetry(f"auction {auction_id} does not exist")
            conn.execute(
                update(auction)
                .where(auction.c.id == auction_id, auction.c.status == "open")
                .values(status="ended")
            )
        logger.info("auction {} ended; winner {} at {}", auction_id, row.winner, row.top_bid)

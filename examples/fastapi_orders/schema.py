"""The shop's own tables, in the ledger's database (`tx=` needs the task row in the same one)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Engine, Integer, MetaData, String, Table

shop = MetaData()

orders = Table(
    "shop_order",
    shop,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("sku", String(64), nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("status", String(16), nullable=False),  # unpaid, paid, closed
    Column("created_at_ms", BigInteger, nullable=False),
    Column("closed_at_ms", BigInteger, nullable=True),
)

stock = Table(
    "shop_stock",
    shop,
    Column("sku", String(64), primary_key=True),
    Column("available", Integer, nullable=False),
)


def create_tables(engine: Engine) -> None:
    """Create the shop's tables if they do not exist."""
    shop.create_all(engine, checkfirst=True)

"""`manage.py migrate` makes the ledger `keyexpiry init-db` makes, on every engine, and adopts
a ledger `init-db` made earlier with its rows kept."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, inspect

from keyexpiry import Client
from keyexpiry.django.settings import keyexpiry_settings
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.ledger.store import Store, make_engine
from keyexpiry.ledger.table import metadata
from keyexpiry.registry import Registry
from tests.django.conftest import migrate

pytestmark = pytest.mark.usefixtures("django_project")


def schema(engine: Engine) -> dict[str, Any]:
    """Every ledger table's columns (type, nullability, default), keys and indexes."""
    insp = inspect(engine)
    out: dict[str, Any] = {}
    for table in sorted(metadata.tables):
        out[table] = {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                for c in insp.get_columns(table)
            ],
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "unique": sorted(
                (u["name"], tuple(u["column_names"])) for u in insp.get_unique_constraints(table)
            ),
            "indexes": sorted(
                (i["name"], tuple(str(c) for c in i["column_names"]), bool(i["unique"]))
                for i in insp.get_indexes(table)
            ),
        }
    return out


def test_migrate_makes_init_dbs_schema(django_project: str) -> None:
    engine = make_engine(django_project)
    try:
        Store(engine).create_schema(all_indexes=True)  # what `keyexpiry init-db` runs
        by_init_db = schema(engine)
        metadata.drop_all(engine)
        engine.dispose()
        migrate()
        by_migrate = schema(engine)
    finally:
        engine.dispose()
    assert set(by_migrate) == {
        "time_limit_task",
        "keyexpiry_listener",
        "keyexpiry_pause",
        "keyexpiry_schedule",
    }
    assert by_migrate == by_init_db


def test_migrate_adopts_an_init_db_ledger_with_its_rows(django_project: str) -> None:
    producer = Client(keyexpiry_settings(), registry=Registry())  # init-db's schema, then a row
    try:
        key = producer.create("Orders.close", "218", ttl_s=600, tag="order:218")
        migrate()
        migrate("keyexpiry", "zero")  # never drops the ledger
        migrate()
        row = producer.store.get(key)
        assert row is not None and row.status is TaskStatus.PENDING and row.tag == "order:218"
    finally:
        producer.close()
    from keyexpiry.django.models import Task

    assert list(Task.objects.values_list("task_key", flat=True)) == [key]
    with pytest.raises(TypeError):
        Task.objects.get().save()

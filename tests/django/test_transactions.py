"""`tx=` on Django's connection, and the backend's enqueue inside `transaction.atomic()`: the row
in the caller's transaction, the key only after its commit, nothing after a rollback; on SQLite,
MariaDB and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection, connections, transaction

from keyexpiry.django.clients import client
from keyexpiry.errors import ArgumentError
from keyexpiry.ledger.rows import TaskStatus
from tests import sample_tasks
from tests.django.conftest import point_default_at
from tests.django.shop.models import Order
from tests.django.shop.tasks import add

pytestmark = pytest.mark.usefixtures("django_db")

TARGET = "Probe.record"


@pytest.fixture(autouse=True)
def _sample_tasks() -> None:
    sample_tasks.reset()


def key_armed(key: str) -> bool:
    return bool(client().redis.exists(key))


def test_create_in_atomic_commits_with_the_callers_work() -> None:
    ke = client()
    # django.db.connection, connections[alias] and the alias itself name one transaction.
    for tx in (connection, connections["default"], "default"):
        with transaction.atomic():
            order = Order.objects.create()
            key = ke.create(TARGET, str(order.id), ttl_s=60, tx=tx)
            assert not key_armed(key)  # the key waits for the commit
        row = ke.store.get(key)
        assert row is not None and row.status is TaskStatus.PENDING
        assert key_armed(key)
        assert Order.objects.filter(id=order.id).exists()  # Django's transaction committed whole


def test_rollback_leaves_neither_row_nor_key() -> None:
    ke = client()
    with pytest.raises(RuntimeError), transaction.atomic():
        order = Order.objects.create()
        key = ke.create(TARGET, str(order.id), ttl_s=60, tx=connection)
        raise RuntimeError("the view failed")
    assert ke.store.get(key) is None
    assert not key_armed(key)
    assert not Order.objects.exists()


def test_savepoint_rolled_back_keeps_the_outer_work() -> None:
    ke = client()
    with transaction.atomic():
        order = Order.objects.create()
        kept = ke.create(TARGET, "1", ttl_s=60, tx=connection)
        try:
            with transaction.atomic():
                undone = ke.create(TARGET, "2", ttl_s=60, tx=connection)
                raise RuntimeError("inner block fails")
        except RuntimeError:
            pass
    assert ke.store.get(kept) is not None and key_armed(kept)
    assert ke.store.get(undone) is None and not key_armed(undone)
    assert Order.objects.filter(id=order.id).exists()


def test_outside_atomic_the_key_is_armed_at_once() -> None:
    ke = client()
    key = ke.create(TARGET, "7", ttl_s=60, tx=connection)
    assert key_armed(key)
    assert ke.store.get(key) is not None
    assert connection.get_autocommit()  # left as it was


def test_cancel_in_atomic_follows_the_commit() -> None:
    ke = client()
    key = ke.create(TARGET, "8", ttl_s=60)
    with pytest.raises(RuntimeError), transaction.atomic():
        assert ke.cancel(TARGET, "8", tx=connection)
        raise RuntimeError("rolled back")
    row = ke.store.get(key)
    assert row is not None and row.status is TaskStatus.PENDING and key_armed(key)
    with transaction.atomic():
        assert ke.cancel(TARGET, "8", tx=connection)
        assert key_armed(key)  # deleted only after the commit
    row = ke.store.get(key)
    assert row is not None and row.status is TaskStatus.CANCELLED and not key_armed(key)


def test_enqueue_in_atomic_is_the_callers_transaction() -> None:
    ke = client()
    with pytest.raises(RuntimeError), transaction.atomic():
        lost = add.enqueue(1, 2)
        raise RuntimeError("rolled back")
    assert ke.store.get(lost.id) is None and not key_armed(lost.id)
    with transaction.atomic():
        order = Order.objects.create()
        kept = add.using(run_after=_later()).enqueue(order.id, 2)
        assert not key_armed(kept.id)
    assert ke.store.get(kept.id) is not None and key_armed(kept.id)


def test_a_failed_statement_does_not_end_djangos_connection() -> None:
    # The bridge closes after every call: Django's connection and transaction go on.
    with transaction.atomic():
        client().create(TARGET, "9", ttl_s=60, tx=connection)
        Order.objects.create()
        client().create(TARGET, "10", ttl_s=60, tx=connection)
    assert Order.objects.count() == 1
    assert connection.connection is not None


def _later() -> object:
    import datetime as dt

    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_connection_to_another_database_is_refused(tmp_path: Path) -> None:
    point_default_at(
        {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "other.sqlite3")},
        alias="other",
    )
    with pytest.raises(ArgumentError, match="another database"):
        client().create(TARGET, "11", ttl_s=60, tx="other")
    with pytest.raises(ArgumentError, match="not a Django database alias"):
        client().create(TARGET, "12", ttl_s=60, tx="nowhere")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_connection_of_another_thread_is_refused() -> None:
    import threading

    mine = connections["default"]
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            client().create(TARGET, "13", ttl_s=60, tx=mine)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ArgumentError), errors
    assert "another thread" in str(errors[0])

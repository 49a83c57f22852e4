"""The Django app `keyexpiry.django` (label `keyexpiry`). On `ready()`: `tx=` learns Django's
connections; `migrate` leaves a SQLite ledger in WAL mode; and a change of `KEYEXPIRY` or
`DATABASES` (a test's `override_settings`) closes the process's Client so the next call reads
the settings anew."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class KeyexpiryConfig(AppConfig):
    """keyexpiry's app: ledger models (read-only), migrations, `manage.py keyexpiry`."""

    name = "keyexpiry.django"
    label = "keyexpiry"
    verbose_name = "keyexpiry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import setting_changed
        from django.db.models.signals import post_migrate

        from keyexpiry.django.connections import django_tx
        from keyexpiry.ledger.transactions import add_tx_adapter

        add_tx_adapter(django_tx)
        setting_changed.connect(_settings_changed, dispatch_uid="keyexpiry.settings_changed")
        post_migrate.connect(_sqlite_in_wal, sender=self, dispatch_uid="keyexpiry.wal")


def _sqlite_in_wal(*, using: str, **_kwargs: Any) -> None:
    # keyexpiry's pool puts a SQLite ledger in WAL mode when it first connects, which waits for
    # no open writer: a first enqueue inside a request's transaction would find the file
    # locked. Done once here, after `migrate` (WAL lasts: it is the file's mode).
    from django.db import connections

    from keyexpiry.django.settings import ledger_alias

    connection = connections[using]
    if using == ledger_alias() and connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")


def _settings_changed(*, setting: str, **_kwargs: Any) -> None:
    if setting in ("KEYEXPIRY", "DATABASES"):
        from keyexpiry.django.clients import reset

        reset()

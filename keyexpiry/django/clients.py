"""The process's keyexpiry `Client`, built once from settings.py (`keyexpiry.django.settings`)
and rebuilt when a test changes `KEYEXPIRY` or `DATABASES`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keyexpiry.client import Client

_lock = threading.Lock()
_client: Client | None = None


def client() -> Client:
    """The Client of this Django process: `keyexpiry.django.client().create(..., tx=connection)`.

    Its ledger is the `KEYEXPIRY["DATABASE"]` alias (tables made by `manage.py migrate`), its
    registry the default one, where Django task functions are registered as they are used."""
    global _client
    with _lock:
        if _client is None:
            from keyexpiry.client import Client
            from keyexpiry.django.settings import keyexpiry_settings

            ke = Client(keyexpiry_settings(), ensure_schema=False)
            # Connects the ledger's pool now, not first inside a caller's transaction: on SQLite
            # its first connection switches the file to WAL, which waits for no open writer.
            ke.store.identity()
            _client = ke
        return _client


def reset() -> None:
    """Close the Client (and forget the bridges to Django's connections): settings changed."""
    global _client
    from keyexpiry.django.connections import forget_engines

    with _lock:
        old, _client = _client, None
    if old is not None:
        old.close()
    forget_engines()

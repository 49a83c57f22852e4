"""keyexpiry: delayed tasks on Redis keyspace notifications, with a SQL ledger."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyexpiry.client import Client
    from keyexpiry.context import TaskContext, current
    from keyexpiry.creates import TaskRequest
    from keyexpiry.errors import (
        ArgumentError,
        ConfigError,
        DoNotRetry,
        EmbeddedServerError,
        KeyExpiryError,
        KeyFormatError,
        NotPendingError,
        RedisConfigError,
        RedisUnavailableError,
        Retry,
        StoreError,
        TaskNotFoundError,
        UnknownTaskError,
    )
    from keyexpiry.flow.pauses import Pause
    from keyexpiry.ledger.if_exists import Did, IfExists, Scheduled
    from keyexpiry.ledger.rows import TaskRow, TaskStatus
    from keyexpiry.listener.listener import Listener
    from keyexpiry.registry import Registry, default_registry, exposed, signature, task
    from keyexpiry.settings import Settings

# Each public name is imported on first use, not with the package: `keyexpiry --help` and a
# listener's start would otherwise pay for SQLAlchemy, redis-py and the cron parser up front.
_EXPORTS = {
    "ArgumentError": "keyexpiry.errors",
    "Client": "keyexpiry.client",
    "ConfigError": "keyexpiry.errors",
    "Did": "keyexpiry.ledger.if_exists",
    "DoNotRetry": "keyexpiry.errors",
    "EmbeddedServerError": "keyexpiry.errors",
    "IfExists": "keyexpiry.ledger.if_exists",
    "KeyExpiryError": "keyexpiry.errors",
    "KeyFormatError": "keyexpiry.errors",
    "Listener": "keyexpiry.listener.listener",
    "NotPendingError": "keyexpiry.errors",
    "Pause": "keyexpiry.flow.pauses",
    "RedisConfigError": "keyexpiry.errors",
    "RedisUnavailableError": "keyexpiry.errors",
    "Registry": "keyexpiry.registry",
    "Retry": "keyexpiry.errors",
    "Scheduled": "keyexpiry.ledger.if_exists",
    "Settings": "keyexpiry.settings",
    "StoreError": "keyexpiry.errors",
    "TaskContext": "keyexpiry.context",
    "TaskNotFoundError": "keyexpiry.errors",
    "TaskRequest": "keyexpiry.creates",
    "TaskRow": "keyexpiry.ledger.rows",
    "TaskStatus": "keyexpiry.ledger.rows",
    "UnknownTaskError": "keyexpiry.errors",
    "current": "keyexpiry.context",
    "default_registry": "keyexpiry.registry",
    "exposed": "keyexpiry.registry",
    "signature": "keyexpiry.registry",
    "task": "keyexpiry.registry",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keyexpiry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "ArgumentError",
    "Client",
    "ConfigError",
    "Did",
    "DoNotRetry",
    "EmbeddedServerError",
    "IfExists",
    "KeyExpiryError",
    "KeyFormatError",
    "Listener",
    "NotPendingError",
    "Pause",
    "RedisConfigError",
    "RedisUnavailableError",
    "Registry",
    "Retry",
    "Scheduled",
    "Settings",
    "StoreError",
    "TaskContext",
    "TaskNotFoundError",
    "TaskRequest",
    "TaskRow",
    "TaskStatus",
    "UnknownTaskError",
    "current",
    "default_registry",
    "exposed",
    "signature",
    "task",
]
__version__ = "0.1.0"

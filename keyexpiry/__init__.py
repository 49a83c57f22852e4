"""keyexpiry: delayed tasks on Redis keyspace notifications, with a SQL ledger."""

from keyexpiry.client import Client, TaskRequest
from keyexpiry.context import TaskContext, current
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
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.scheduling import Did, IfExists, Scheduled
from keyexpiry.listener.listener import Listener
from keyexpiry.pausing import Pause
from keyexpiry.registry import Registry, default_registry, exposed, signature, task
from keyexpiry.settings import Settings

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
